#!/usr/bin/env bash
# Makes, once per machine, the Python environments that measure archipelago's peers beside its
# bench: PyTorch (gloo collectives, DDP steps, the reference fixtures), Ray 2.60 and Monarch 0.7
# (actor messaging, Ray's compiled graphs), and Hugging Face's transformers 4.57 / peft 0.17 (the
# GPT-2 and LoRA fixtures). They live outside the repository (default
# ~/.cache/archipelago-peers, or $ARCHIPELAGO_PEERS) and are never used by the build, the tests
# or CI. Needs only PyPI.
#
#   bash scripts/peers_venv.sh            # makes (or completes) every environment
#   bash scripts/peers_venv.sh hf         # only Hugging Face's (transformers, peft): the GPT-2 fixtures
#   bash scripts/peers_venv.sh serve      # only OpenAI's client and Prometheus' parser: scripts/openai_check.py
#   ~/.cache/archipelago-peers/torch-ray/bin/python scripts/actor_peers.py --system ray
#   ~/.cache/archipelago-peers/monarch/bin/python scripts/actor_peers.py --system monarch
#   ~/.cache/archipelago-peers/torch-ray/bin/python scripts/torch_reference.py --device cpu ...
set -euo pipefail
root="${ARCHIPELAGO_PEERS:-$HOME/.cache/archipelago-peers}"
mkdir -p "$root"
# Monarch 0.7 wants a newer torch than the reference scripts pin, so it gets its own environment.
make_env() {
    local name="$1"; shift
    if [ ! -x "$root/$name/bin/python" ]; then
        python3 -m venv "$root/$name"
    fi
    "$root/$name/bin/pip" install --quiet --disable-pip-version-check "$@"
    echo "$root/$name:"
    "$root/$name/bin/pip" list --disable-pip-version-check 2>/dev/null | grep -E -i '^(torch|ray|torchmonarch|numpy|safetensors) '
}
which="${1:-all}"
if [ "$which" = all ] || [ "$which" = torch-ray ]; then
    make_env torch-ray torch==2.5.1 "ray[default]==2.60.0" numpy safetensors
fi
if [ "$which" = all ] || [ "$which" = monarch ]; then
    make_env monarch torch==2.9.0 torchmonarch==0.7.0
fi
# OpenAI's official client and Prometheus' parser, against `archipelago serve` (scripts/openai_check.py).
if [ "$which" = all ] || [ "$which" = serve ]; then
    make_env serve openai==2.8.1 prometheus_client==0.23.1
fi
# Hugging Face's stack for the GPT-2 / LoRA fixtures (scripts/gpt2_fixture.py).
if [ "$which" = all ] || [ "$which" = hf ]; then
    make_env hf torch==2.9.0 transformers==4.57.6 peft==0.17.1 tokenizers==0.22.1 safetensors numpy
fi
