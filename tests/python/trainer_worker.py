"""One process of test_train_hf.py's Trainer-under-torchrun test (not a test module itself).

    MASTER_ADDR=... MASTER_PORT=... RANK=r WORLD_SIZE=w LOCAL_RANK=r python trainer_worker.py CKPT OUT [--per-rank]

As a user's script under torchrun: transformers' TrainingArguments (CPU, gloo) initializes
torch.distributed, then ``tandem.load_model(..., train=True)`` (the machine's ranks share one
copy of the experts unless --per-rank), PEFT LoRA on attention and experts with fixed random
adapters, and the stock Trainer (it wraps the model in DDP and shards the data) runs STEPS
plain-SGD steps. Writes OUT.rank<r>: the logged losses, the trainable parameters before and
after, and the experts modules' kinds.
"""
from __future__ import annotations

import os
import sys

STEPS = 3


def main() -> None:
    os.environ.setdefault("TANDEM_TORCH_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    import tandem
    from ddp_worker import lora_config, random_lora, trainable
    from test_train_hf import TokenDataset

    ckpt, out = sys.argv[1], sys.argv[2]
    per_rank = "--per-rank" in sys.argv[3:]
    args = TrainingArguments(output_dir=f"{out}.dir", use_cpu=True, ddp_backend="gloo", report_to=[],
                             save_strategy="no", logging_steps=1, dataloader_num_workers=0, seed=5, max_steps=STEPS,
                             per_device_train_batch_size=2, remove_unused_columns=False, learning_rate=0.5,
                             optim="sgd", warmup_steps=0, lr_scheduler_type="constant", weight_decay=0.0,
                             disable_tqdm=True)
    assert args.world_size == int(os.environ["WORLD_SIZE"])
    _ = args.device  # initializes torch.distributed (gloo), as Trainer would
    cfg = {"version": 1, "cpu": {"threads": 1}, "gpu": {"device": "none"},
           "distributed": {"cpu_experts": "per_rank" if per_rank else "auto"}}
    model = tandem.load_model(ckpt, cfg, train=True, dtype=torch.float32, progress=False)
    model = get_peft_model(model, lora_config())
    random_lora(model, 11)
    initial = trainable(model)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(n=8))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    experts = [type(m).__name__ + ("" if m.lora_layer is not None else " (remote)")
               for m in model.modules() if hasattr(m, "lora_layer")]
    import torch.distributed as dist

    torch.save({"losses": losses, "initial": initial, "params": trainable(model), "experts": experts},
               f"{out}.rank{dist.get_rank()}")
    dist.barrier()


if __name__ == "__main__":
    main()
