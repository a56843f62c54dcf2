"""A character-level LSTM language model in a plain script's epoch × batch loop: per-epoch
validation, best-model save, learning-rate annealing, Ctrl-C to stop early. char_lm.py trains
on one machine; char_lm_gradientmail.py is the same script as one learner of a gradientmail run.
docs/integrations.md shows the diff between the two and how to run them.
"""

import argparse
import copy
import math
import random
import time
from pathlib import Path

import torch
from torch import nn

import gradientmail.sync
from gradientmail.patterns import shard_of

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--data", help="a text file (default: sentences generated here)")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batches", type=int, default=200, help="training batches per epoch")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--bptt", type=int, default=32, help="sequence length")
parser.add_argument("--hidden", type=int, default=128)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--save", default="char_lm.pt", help="where the best model goes")
parser.add_argument("--run", required=True, help="the run's bucket URL or directory")
parser.add_argument("--learner", required=True, help="this learner's id, e.g. host-0")
parser.add_argument("--learners", type=int, default=2, help="how many learners share the data")
args = parser.parse_args()
torch.manual_seed(args.seed)


def sentences(count: int, seed: int) -> str:
    words = [
        "the",
        "a",
        "mail",
        "bucket",
        "learner",
        "round",
        "sends",
        "reads",
        "merges",
        "model",
        "step",
        "every",
    ]
    rng = random.Random(seed)
    return "".join(" ".join(rng.choices(words, k=rng.randint(3, 9))) + ". " for _ in range(count))


text = Path(args.data).read_text() if args.data else sentences(4000, seed=0)
vocabulary = sorted(set(text))
codes = torch.tensor([vocabulary.index(c) for c in text])
split = int(len(codes) * 0.9)
train_data = shard_of(args.learner, count=args.learners).take(codes[:split])
valid_data = codes[split:]


class Model(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0])


def batch(source: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(source) - args.bptt - 1, (args.batch_size,), generator=generator)
    rows = torch.stack([source[s : s + args.bptt + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


model = Model(len(vocabulary), args.hidden)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
loss_of = nn.CrossEntropyLoss()


def evaluate(source: torch.Tensor) -> float:
    model.eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        losses = [
            loss_of(model(x).flatten(0, 1), y.flatten())
            for x, y in (batch(source, generator) for _ in range(20))
        ]
    model.train()
    return float(torch.stack(losses).mean())


# Loop over epochs. At any point you can hit Ctrl + C to break out of training early.
best = math.inf
node = gradientmail.sync.open(model, args.run, learner=args.learner, handle_signals=True)
try:
    for epoch in range(1, args.epochs + 1):
        generator = torch.Generator().manual_seed(args.seed + epoch)
        started = time.time()
        for index in range(args.batches):
            x, y = batch(train_data, generator)
            optimizer.zero_grad()
            loss = loss_of(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            optimizer.step()
            node.step(tokens=x.numel())
            if index % 50 == 0:
                print(
                    f"| epoch {epoch} | batch {index} | loss {loss.item():.3f} "
                    f"| {1e3 * (time.time() - started) / (index + 1):.1f} ms/batch",
                    flush=True,
                )
        trained, model = model, node.shared_model(into=copy.deepcopy(model))  # the run's model
        valid = evaluate(valid_data)
        print(f"| end of epoch {epoch} | valid loss {valid:.3f} | ppl {math.exp(valid):.2f}")
        if valid < best:
            torch.save(model.state_dict(), args.save)
            best = valid
        else:
            for group in optimizer.param_groups:
                group["lr"] /= 4.0
        model = trained
except KeyboardInterrupt:
    print("Exiting from training early")
node.close()
model.load_state_dict(torch.load(args.save))
print(f"| end of training | valid loss {evaluate(valid_data):.3f}")
