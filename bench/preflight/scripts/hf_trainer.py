"""An unmodified Hugging Face Trainer script: a small BERT from its config (no download).

Its eval and save come every 50 steps; preflight asks the Trainer for both after its 3rd
step. Usage: python hf_trainer.py OUTPUT_DIR
"""

import sys

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

cfg = BertConfig(
    vocab_size=3000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    num_labels=3,
)
model = BertForSequenceClassification(cfg)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return {
            "input_ids": torch.randint(0, 3000, (32,)),
            "attention_mask": torch.ones(32, dtype=torch.long),
            "labels": torch.tensor(i % 3),
        }


args = TrainingArguments(
    output_dir=sys.argv[1],
    per_device_train_batch_size=16,
    per_device_eval_batch_size=32,
    num_train_epochs=3,
    eval_strategy="steps",
    eval_steps=50,
    save_steps=50,
    logging_steps=10,
    report_to=[],
    disable_tqdm=True,
)
Trainer(model=model, args=args, train_dataset=Data(), eval_dataset=Data()).train()
