"""``kvcompress serve`` driven by the official ``openai`` SDK and by bad clients, as a real
process on 127.0.0.1 (one server for the module; the embedded retrieval model, h2o budget 32,
no Hugging Face cache on the machine). Every request loop is bounded in count and time."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest

import _serve_helpers as H
from kvcompress.bench import _serving as srv

openai = pytest.importorskip("openai")

CAPACITY = 40  # --max-concurrent-requests: room for the 32 clients below, small enough to fill


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-api")
    model = H.write_model(tmp / "model")
    p = H.start(tmp, model, "--max-concurrent-requests", str(CAPACITY), "--max-tokens", "64")
    yield p, srv.load_tokenizer(model)
    assert p.stop() == 0  # SIGTERM is a normal shutdown


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt(tok, n=48, seed=0) -> str:
    return srv.haystack_text(tok, n, seed)


def test_sdk_models_list_without_a_hugging_face_cache(client, server):
    ids = [m.id for m in client.models.list().data]
    assert len(ids) == 1 and ids[0].endswith("model")
    assert client.models.retrieve(ids[0]).id == ids[0]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_sdk_completions_streaming_and_not_agree(client, server):
    prompt = _prompt(server[1])
    kw = dict(model="default_model", prompt=prompt, max_tokens=24, temperature=0, logit_bias=H.BAN)
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(server[1].encode(prompt))
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 24


def test_sdk_chat_streaming_and_not_agree(client, server):
    ids = [m.id for m in client.models.list().data]
    kw = dict(model=ids[0], messages=[{"role": "system", "content": "a b c"}, {"role": "user", "content": _prompt(server[1])}],
              max_tokens=16, temperature=0, logit_bias=H.BAN)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 16
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices)
    assert text == r.choices[0].message.content


def test_sdk_concurrent_clients_get_their_own_answers(client, server):
    """Eight concurrent SDK clients (streaming and not) are batched; each greedy answer equals
    the one it gets alone."""
    prompts = [_prompt(server[1], 40, seed) for seed in range(8)]
    alone = [client.completions.create(model="default_model", prompt=p, max_tokens=12, temperature=0,
                                       logit_bias=H.BAN).choices[0].text for p in prompts[:2]]
    out: dict = {}

    def run(i):
        kw = dict(model="default_model", prompt=prompts[i], max_tokens=12, temperature=0, logit_bias=H.BAN)
        if i % 2:
            out[i] = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
        else:
            out[i] = client.completions.create(**kw).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(out) == list(range(8))
    assert out[0] == alone[0] and out[1] == alone[1]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "stop": [5]}, "stop[0]"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt[0]"),
    ({"prompt": [100000]}, "prompt"),  # outside the vocabulary: refused in the generation thread
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "a", "max_tokenz": 5}, "max_tokenz"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "a", "n": CAPACITY + 1}, "n"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, "tool_choice"),
])
def test_bad_fields_are_400_naming_the_field_and_the_server_goes_on(server, body, param):
    p, _ = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, r, _ = H.post(p.url + path, body)
    assert status == 400, r
    assert r["error"]["param"] == param and r["error"]["message"]
    assert H.get(p.url + "/health")[0] == 200
    status, r, _ = H.post(p.url + "/v1/completions", {"prompt": "a b", "max_tokens": 2, "logit_bias": H.BAN})
    assert status == 200 and r["usage"]["completion_tokens"] == 2


def test_stop_sequences_end_the_text_and_the_generation(client, server):
    prompt = _prompt(server[1], 40, 3)
    kw = dict(model="default_model", prompt=prompt, temperature=0, logit_bias=H.BAN)
    full = client.completions.create(**kw, max_tokens=40).choices[0].text
    words = full.split()
    stop = next(w for w in words[3:] if len(w) > 1)  # a word the answer reaches later
    r = client.completions.create(**kw, max_tokens=40, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.usage.completion_tokens < 40
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, max_tokens=40, stop=stop, stream=True))
    assert streamed == r.choices[0].text
    dot = client.completions.create(**kw, max_tokens=40, stop=[" "])  # a single character stops too
    assert dot.choices[0].finish_reason == "stop" and " " not in dot.choices[0].text


def test_logprobs_as_openai_documents(client, server):
    prompt = _prompt(server[1], 24, 4)
    r = client.completions.create(model="default_model", prompt=prompt, max_tokens=5, temperature=0, logprobs=3,
                                  logit_bias=H.BAN)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, lp_tok, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and lp_tok <= 0 and max(top.values()) == pytest.approx(lp_tok, abs=1e-5)  # greedy
    c = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": prompt}],
                                       max_tokens=4, logprobs=True, top_logprobs=2, logit_bias=H.BAN, temperature=0)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)


def test_n_echo_and_several_prompts(client, server):
    tok = server[1]
    p1, p2 = _prompt(tok, 20, 5), _prompt(tok, 20, 6)
    r = client.completions.create(model="default_model", prompt=[p1, p2], n=2, max_tokens=6, temperature=0,
                                  logit_bias=H.BAN, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[0].text.startswith(p1)
    assert r.choices[2].text.startswith(p2) and r.choices[2].text != r.choices[0].text
    assert r.usage.completion_tokens == 4 * 6
    assert r.usage.prompt_tokens == len(tok.encode(p1)) + len(tok.encode(p2))
    chat = client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": p1}], n=3,
                                          max_tokens=4, temperature=0, logit_bias=H.BAN)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1
    seeded = [client.completions.create(model="default_model", prompt=p1, n=2, max_tokens=16, temperature=5.0,
                                        seed=11, logit_bias=H.BAN) for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]  # reproducible
    assert seeded[0].choices[0].text != seeded[0].choices[1].text  # and each choice its own sample


def test_token_id_prompts(client, server):
    tok = server[1]
    text = _prompt(tok, 24, 7)
    ids = tok.encode(text)
    kw = dict(model="default_model", max_tokens=8, temperature=0, logit_bias=H.BAN)
    by_text = client.completions.create(prompt=text, **kw)
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    both = client.completions.create(prompt=[ids, ids[:10]], **kw)
    assert len(both.choices) == 2 and both.choices[0].text == by_text.choices[0].text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's CPU time from /proc")
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_generation(server, stream):
    """A long generation keeps the server busy; once its client disconnects (streaming or not)
    the server goes idle within a second."""
    p, tok = server
    body = json.dumps({"prompt": _prompt(tok, 24, 8), "max_tokens": 10**6, "temperature": 0, "stream": stream,
                       "logit_bias": H.BAN}).encode()
    sock = socket.create_connection(("127.0.0.1", p.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(1.0)
    busy = H.busy_ticks(p.pid, 1.0)
    sock.close()
    time.sleep(1.0)
    idle = H.busy_ticks(p.pid, 2.0)
    assert busy >= 20, f"the generation did not run ({busy} ticks/s)"
    assert idle <= 10, f"still generating after the client left ({idle} ticks in 2 s, {busy} ticks/s before)"
    assert H.get(p.url + "/health")[1]["generations_held"] == 0


def test_32_simultaneous_clients_are_all_answered(server):
    """No connection is reset: all 32 get their answer (the queue holds those the batch cannot)."""
    p, tok = server
    results: list = [None] * 32
    go = threading.Barrier(32)

    def run(i):
        go.wait(timeout=30)
        try:
            results[i] = H.post(p.url + "/v1/completions", {"prompt": _prompt(tok, 16, 100 + i), "max_tokens": 8,
                                                           "logit_bias": H.BAN}, timeout=120)[0]
        except OSError as exc:
            results[i] = repr(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert results == [200] * 32, results


def test_a_full_server_answers_503_with_retry_after(server, client):
    """Every slot held (one streamed request with n = capacity): the next request is refused at
    once with 503 and Retry-After -- the SDK sees the status, not a reset -- and served again as
    soon as the slots are free."""
    p, tok = server
    body = json.dumps({"prompt": _prompt(tok, 16, 9), "n": CAPACITY, "max_tokens": 10**6, "stream": True,
                       "logit_bias": H.BAN}).encode()
    sock = socket.create_connection(("127.0.0.1", p.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 30
        while H.get(p.url + "/health")[1]["generations_held"] < CAPACITY and time.monotonic() < deadline:
            time.sleep(0.1)
        status, r, headers = H.post(p.url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert status == 503 and r["error"]["code"] == "server_at_capacity"
        assert int(headers["Retry-After"]) >= 1
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="default_model", prompt="a", max_tokens=2)
        assert err.value.status_code == 503
    finally:
        sock.close()
    deadline = time.monotonic() + 30
    while H.get(p.url + "/health")[1]["generations_held"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.completions.create(model="default_model", prompt="a b", max_tokens=2).usage.completion_tokens >= 1


def test_the_same_prompts_again_reuse_their_caches_after_concurrent_requests(server):
    """8 concurrent prompts longer than the budget, then the same 8 again: each is served from
    the prompt cache (--prompt-cache-size 10, the default) and prefills its last token only --
    what plain mlx-lm reuses at the same settings."""
    from kvcompress.bench import _serving_client as sc

    p, tok = server
    prompts = [_prompt(tok, 120, 200 + i) for i in range(8)]
    first = sc.load_round(p.url, prompts, 4, srv.SPECIAL_IDS, 120)
    again = sc.load_round(p.url, prompts, 4, srv.SPECIAL_IDS, 120)
    assert all(q["cached_tokens"] == 0 for q in first["requests"])
    assert [q["cached_tokens"] for q in again["requests"]] == [q["prompt_tokens"] - 1 for q in again["requests"]]
