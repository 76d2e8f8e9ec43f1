"""Writes the tokenizer fixture of issue 40: a tiny GPT-2-style byte-level BPE `tokenizer.json`
trained with Hugging Face's `tokenizers` (0.22.x, pip) on the corpus below, and the ids it gives
for a fixed text (`ids.json`). The Rust tests read both; no Python runs at test time.

    python3 -m venv /tmp/tok && /tmp/tok/bin/pip install tokenizers==0.22.1
    /tmp/tok/bin/python scripts/tokenizer_fixture.py integration-tests/fixtures/tokenizer
"""

import json
import os
import sys

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A single controller compiles one program into a stream per device.",
    "Pipelines, tensors and replicas: the same parameters, step for step.",
    "Low-rank adapters learn B·A while the base stays frozen.",
    "Ünïcödé, tabs\tand  double  spaces survive byte-level BPE; so do emojis 🙂.",
] * 4

TEXT = "The lazy fox compiles a stream: B·A, 🙂 and  two  spaces.\nNew line."


def main(out_dir):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    expected = {
        "tokenizers_version": tokenizers.__version__,
        "vocab_size": tok.get_vocab_size(),
        "text": TEXT,
        "ids": ids,
        "decoded": tok.decode(ids),
    }
    with open(os.path.join(out_dir, "ids.json"), "w") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{len(ids)} ids, vocabulary {tok.get_vocab_size()}, written to {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "integration-tests/fixtures/tokenizer")
