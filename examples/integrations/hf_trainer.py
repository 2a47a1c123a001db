"""A Hugging Face Trainer run on Poplar: a small Llama on an uneven, emulated 3-GPU cluster.

    torchrun --standalone --nproc-per-node 3 examples/integrations/hf_trainer.py

(a few minutes on a CPU, most of it the emulated GPUs' pacing; ``POPLAR_DILATION=3``
in front paces faster, the losses unchanged, the emulated step times then less faithful).

The cluster (examples/cluster-3.yaml) is one A100 beside two T4s, emulated on this host:
each rank's steps take its GPU's time. The plan gives the A100 most of every global batch
(ZeRO-1: unequal micro-batches and accumulation), and ``PoplarTrainer`` trains exactly as
one device would on the whole batch. The data is a learnable synthetic token stream (a
random bigram chain), so the loss visibly falls. Options: ``--profile`` plans by profiling
the cluster instead of using the fixed plan; ``--resume`` continues from the newest
checkpoint in the output folder, exactly where the run left it.
"""

import argparse
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import poplar
from poplar.data.synthetic import bigram_batches
from poplar.integrations.hf import PoplarTrainer
from poplar.models.workload import Workload

HERE = Path(__file__).resolve().parents[1]
SEQ_LEN, VOCAB = 32, 256
# 8 per device x 3 ranks = 24 samples a step: the A100 takes 16 in two micro-batches, each T4 4 in one
PLAN = poplar.Plan.from_local_batches(1, [16, 4, 4], [2, 1, 1])


def model() -> LlamaForCausalLM:
    """A ~0.3M-parameter Llama from a config (no download); the same seed on every rank."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        tie_word_embeddings=False))


def dataset(n: int) -> list[dict]:
    tokens, _ = bigram_batches(1, n, seq_len=SEQ_LEN, vocab_size=VOCAB, seed=0)[0]
    return [{"input_ids": row, "labels": row} for row in tokens]     # the model shifts the labels itself


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="hf-trainer-out")
    ap.add_argument("--profile", action="store_true", help="plan by profiling the cluster, not the fixed plan")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    opts = ap.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(
        output_dir=opts.out, per_device_train_batch_size=24 // world, max_steps=opts.steps, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=5, max_grad_norm=1.0, logging_steps=10, save_steps=20,
        report_to="none", disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False)
    planning = (dict(cluster=HERE / "cluster-3.yaml", workload=Workload(model="llama-tiny", seq_len=SEQ_LEN,
                                                                       vocab_size=VOCAB), stages=(1, 2))
                if opts.profile else dict(plan=PLAN, cluster=HERE / "cluster-3.yaml"))
    trainer = PoplarTrainer(model=model(), args=args, train_dataset=dataset(24 * opts.steps), **planning)
    trainer.train(resume_from_checkpoint=opts.resume or None)
    trainer.save_model(f"{opts.out}/final")           # every rank: the full weights are gathered from the shards
    steps_s = trainer.runtime.steps_s
    state = trainer.runtime.engine.full_state_dict()   # every rank (a collective in stages 1-3)
    if trainer.is_world_process_zero():
        print(f"plan: {trainer.plan}")
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"loss every 10 steps: {' '.join(f'{x:.3f}' for x in losses)}")
        print(f"emulated step time: {sum(steps_s[1:]) / max(len(steps_s) - 1, 1):.3f} s (first step left out)")
        saved = LlamaForCausalLM.from_pretrained(f"{opts.out}/final").state_dict()
        err = max((saved[k] - v).abs().max().item() for k, v in state.items())
        print(f"saved model reloads with from_pretrained: max |difference| {err:.1e}")
    trainer.end()


if __name__ == "__main__":
    main()
