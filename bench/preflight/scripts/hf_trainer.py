"""An unmodified Hugging Face Trainer script: a small BERT from its config (no download).

Its eval and save come every 50 steps; preflight asks the Trainer for both after its 3rd
step. Usage: python hf_trainer.py OUTPUT_DIR [--batch-size N] [--max-steps N]
[--grad-accum N] [--bf16] [--grad-ckpt]
"""

import argparse

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("output_dir")
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--max-steps", type=int, default=-1)
p.add_argument("--eval-steps", type=int, default=50)
p.add_argument("--grad-accum", type=int, default=1)
p.add_argument("--bf16", action="store_true")
p.add_argument("--grad-ckpt", action="store_true")
cli = p.parse_args()

cfg = BertConfig(
    vocab_size=8000,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=1024,
    num_labels=3,
)
model = BertForSequenceClassification(cfg)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return {
            "input_ids": torch.randint(0, 8000, (128,)),
            "attention_mask": torch.ones(128, dtype=torch.long),
            "labels": torch.tensor(i % 3),
        }


args = TrainingArguments(
    output_dir=cli.output_dir,
    per_device_train_batch_size=cli.batch_size,
    per_device_eval_batch_size=2 * cli.batch_size,
    gradient_accumulation_steps=cli.grad_accum,
    bf16=cli.bf16,
    gradient_checkpointing=cli.grad_ckpt,
    num_train_epochs=3,
    max_steps=cli.max_steps,
    eval_strategy="steps",
    eval_steps=cli.eval_steps,
    save_steps=cli.eval_steps,
    logging_steps=10,
    report_to=[],
    disable_tqdm=True,
)
Trainer(model=model, args=args, train_dataset=Data(), eval_dataset=Data()).train()
