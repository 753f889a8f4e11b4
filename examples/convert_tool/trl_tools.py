"""The convert example as a TRL script with ``tools=[...]`` (issue 55): the TRL code it was, with
one import changed and one argument added.

- ``from trl import GRPOConfig, GRPOTrainer`` became ``from peergrade import ...``;
- ``chat_template_path="hermes"``: a template that shows the tools to SmolLM2 (whose own does
  not). A model warmed up with ``peergrade sft --tools ... --chat-template hermes`` already
  carries it; it does no harm there.

    python examples/convert_tool/make_data.py
    python examples/convert_tool/trl_tools.py models/smollm2-convert [STEPS]

MODEL defaults to models/smollm2-convert (the warm-up's output, docs/environments.md, 'Your
tools on your model'); STEPS to 4. The held-out table (20 questions, greedy and one sample) is
printed before and after training.
"""

import os
import sys

from convert_tool import convert, correct
from datasets import load_dataset

from peergrade import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
model = sys.argv[1] if len(sys.argv) > 1 else "models/smollm2-convert"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
data = load_dataset(
    "json",
    data_files={"train": f"{HERE}/train.jsonl", "test": f"{HERE}/eval.jsonl"},
)

args = GRPOConfig(
    output_dir="runs/convert-trl",
    chat_template_path="hermes",  # the one added argument
    max_steps=steps,
    learning_rate=2e-5,
    lr_scheduler_type="constant",
    num_generations=8,
    per_device_train_batch_size=32,  # completions a step: 4 prompts x 8
    max_completion_length=96,
    temperature=1.0,
    beta=0.0,
    loss_type="grpo",
    max_tool_calling_iterations=2,
    num_generations_eval=1,
    seed=0,
    use_cpu=True,
    save_strategy="no",
    report_to="none",
)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=correct,
    args=args,
    train_dataset=data["train"],
    eval_dataset=data["test"].select(range(min(20, len(data["test"])))),
    tools=[convert],
)
trainer.train()
