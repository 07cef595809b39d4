"""Seeded bug: a dataset whose items are listed by iterating a set of strings. A string's hash changes with each
process (PYTHONHASHSEED), so index i is another example in each run and the shuffled batches differ. verify's
determinism check flags it; the twin sorts the set."""

from common import Points, features, parse, run

from accel_train import run_cli


class NamedPoints(Points):
    def __init__(self, n: int, fixed: bool):
        super().__init__(n)
        names = {f"point-{i}" for i in range(n)}
        self.names = sorted(names) if fixed else list(names)  # the bug: a set's order

    def __getitem__(self, i):
        x, y = features(int(self.names[i].split("-")[1]))
        return {"x": x, "labels": y}


def main(argv=None):
    config, bug = parse(argv)
    run(config, bug, NamedPoints(bug.num_samples, bug.fixed))


if __name__ == "__main__":
    run_cli(main)
