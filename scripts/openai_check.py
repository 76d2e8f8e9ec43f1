"""Drives `archipelago serve` with OpenAI's official Python client, as a user's program would:
completions and chat, whole and streamed (with `stream_options.include_usage`), a refusal in
OpenAI's error shape, then `/metrics` parsed by Prometheus' own client parser (OpenMetrics).
Prints what it got; exits non-zero on the first thing that does not hold.

    bash scripts/peers_venv.sh serve
    archipelago serve --init integration-tests/fixtures/gpt2/model.safetensors \
        --tokenizer integration-tests/fixtures/tokenizer/tokenizer.json &
    ~/.cache/archipelago-peers/serve/bin/python scripts/openai_check.py --base-url http://127.0.0.1:8000
"""

import argparse
import sys
import urllib.request

import openai
from prometheus_client.openmetrics.parser import text_string_to_metric_families


def check(condition, what):
    if not condition:
        print(f"FAILED: {what}")
        sys.exit(1)
    print(f"ok: {what}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="none", help="the cluster token, when the server has one")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)
    print(f"openai {openai.__version__}")

    model = client.models.list().data[0].id
    print(f"model: {model}")
    whole = client.completions.create(model=model, prompt="the", max_tokens=8, temperature=0.8, seed=3)
    print(f"completion: {whole.choices[0].text!r} finish={whole.choices[0].finish_reason} usage={whole.usage}")
    check(whole.usage.completion_tokens == 8, "a completion of 8 tokens")
    again = client.completions.create(model=model, prompt="the", max_tokens=8, temperature=0.8, seed=3)
    check(again.choices[0].text == whole.choices[0].text, "the same seed samples the same answer")

    pieces, usage = [], None
    stream = client.completions.create(
        model=model, prompt="the", max_tokens=8, temperature=0.8, seed=3, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    print(f"streamed: {len(pieces)} chunks {''.join(pieces)!r} usage={usage}")
    check("".join(pieces) == whole.choices[0].text, "the streamed chunks add up to the whole answer")
    check(usage is not None and usage.completion_tokens == 8, "the usage chunk comes last")

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    print(f"chat: {chat.choices[0].message.content!r} usage={chat.usage}")
    check(chat.choices[0].message.role == "assistant", "a chat answer from the assistant")
    deltas = []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
    print(f"chat streamed: {''.join(deltas)!r}")
    check("".join(deltas) == chat.choices[0].message.content, "the streamed chat adds up to the whole")

    try:
        client.completions.create(model=model, prompt="the", max_tokens=8, n=2)
        check(False, "n=2 is refused")
    except openai.BadRequestError as e:
        print(f"refused: {e.status_code} {e.body}")
        check(e.body.get("param") == "n", "the refusal names the field n")

    request = urllib.request.Request(
        args.base_url + "/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0", "Authorization": f"Bearer {args.api_key}"},
    )
    with urllib.request.urlopen(request) as response:
        content_type = response.headers["Content-Type"]
        text = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    print(f"/metrics ({content_type}): {len(families)} families parsed by prometheus_client")
    for name in sorted(families):
        samples = families[name].samples
        shown = [f"{s.name}{s.labels or ''}={s.value}" for s in samples if not s.name.endswith("_bucket")]
        print(f"  {families[name].type:9} {', '.join(shown)}")
    generated = families["archipelago_serve_generated_tokens"].samples[0].value
    check(generated >= 8 * 3 + 6 * 2, "generated tokens counted")
    check(families["archipelago_serve_time_to_first_token_seconds"].type == "histogram", "TTFT is a histogram")


if __name__ == "__main__":
    main()
