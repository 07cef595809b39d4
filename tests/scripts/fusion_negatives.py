"""Run by test_multimodal_fusion.py on 1 process (in its own) and on 2 (the session's spawned ranks): draws hard
negatives for one fixed global batch of 8 pairs over many steps and writes what each rank drew to
<out>/negatives_rank<R>.json.

The batch is built so that the most similar "other" item is always a positive in disguise: pairs 0 and 4
share a caption text (caption id 0), pairs 2 and 6 show the same image (image id 2), and image 1's own
captions include the caption shown with image 5 (id 5); each such pair has identical embeddings. Each rank
holds a different number of caption tokens (and of captions per image), so the text states (and the
caption sets) are padded when gathered. The first feature of every text state / image token is its global
row, to check the pairing.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

from accel_train.tasks.multimodal.fusion_loss import HardNegativePairs

IMAGE_IDS = torch.tensor([0, 1, 2, 3, 4, 5, 2, 7])
CAPTION_IDS = torch.tensor([0, 1, 2, 3, 0, 5, 6, 7])
CAPTION_SETS = torch.tensor([[0, -1], [1, 5], [2, 6], [3, -1], [0, -1], [5, -1], [2, 6], [7, -1]])  # each image's


def main(out_dir: str, steps: int = 300) -> None:
    PartialState()  # joins the launched processes (gloo on a CPU)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    b = len(IMAGE_IDS) // world
    rows = slice(rank * b, (rank + 1) * b)
    embeds = torch.nn.functional.normalize(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), dim=-1)
    embeds[4], embeds[5], embeds[6] = embeds[0], embeds[1], embeds[2]  # disguised positives score like the true one
    row_feature = torch.arange(8.0)[:, None, None]
    length = 1 + rank  # the text states of each rank have another length
    out = {"image_embeds": embeds[rows], "text_embeds": embeds[rows], "logit_scale": torch.tensor(100.0),
           "image_tokens": row_feature[rows].expand(b, 3, 2), "text_states": row_feature[rows].expand(b, length, 2),
           "text_mask": torch.ones(b, length, dtype=torch.long)}
    sets = CAPTION_SETS[rows]
    if rank == 1:  # another number of captions per image on each rank: the sets are padded when gathered
        sets = torch.cat([sets, torch.full((b, 1), -1)], 1)
    record = {"caption": [], "image": [], "text_rows": [], "image_rows": [], "length": []}
    for step in range(steps):
        pairs = HardNegativePairs(IMAGE_IDS[rows], CAPTION_IDS[rows], seed=1, step=step,
                                  caption_sets=sets)
        tokens, states, mask = pairs(out)
        record["caption"].append(pairs.negative_caption_ids.tolist())
        record["image"].append(pairs.negative_image_ids.tolist())
        record["text_rows"].append(states[:, 0, 0].long().tolist())
        record["image_rows"].append(tokens[:, 0, 0].long().tolist())
        record["length"].append(states.shape[1])
        assert pairs.valid.all()
    Path(out_dir, f"negatives_rank{rank}.json").write_text(json.dumps(record))
    if dist.is_initialized():  # every rank done before the group goes: a rank leaving early aborted its peer
        dist.barrier()
        time.sleep(0.2)  # gloo's threads free the last collectives' tensors under the GIL first (end_training_safely)
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
