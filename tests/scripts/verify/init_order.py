"""Seeded bug: the model built before anything seeds the generators (before build_accelerator(config), which seeds
them from --seed), so each run starts from other initial weights. verify's determinism check flags it; the twin
builds the model after the accelerator."""

from common import Points, new_model, parse, run

from accel_train import run_cli


def main(argv=None):
    config, bug = parse(argv)
    model = None if bug.fixed else new_model()  # the bug: initialised from an unseeded generator
    run(config, bug, Points(bug.num_samples), model=model)


if __name__ == "__main__":
    run_cli(main)
