"""The parts of ``kvcompress serve`` that need no server: request checks, stop sequences,
admission, the prompt cache's limits, the option parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.mlxlm.prompt_cache import CompressedPromptCache
from kvcompress.serve.admission import Admission
from kvcompress.serve.errors import Overloaded, RequestError
from kvcompress.serve.output import StopText
from kvcompress.serve.schema import ChatBody, CompletionBody, parse

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "a", "stop": 5}, "stop", "string or a list of strings"),
    ({"prompt": "a", "stop": [5]}, "stop[0]", "must be a string"),
    ({"prompt": "a", "stop": [""]}, "stop[0]", "not be empty"),
    ({"prompt": "a", "stop": ["x"] * 17}, "stop", "at most 16"),
    ({"prompt": 5}, "prompt", "list of token ids"),
    ({"prompt": []}, "prompt", "not be empty"),
    ({"prompt": [[1, 2], [3, -1]]}, "prompt[1][1]", ">= 0"),
    ({}, "prompt", "required"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens", "integer"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"prompt": "a", "temperature": True}, "temperature", "number"),
    ({"prompt": "a", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "a", "stream": "yes"}, "stream", "boolean"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usag": True}}, "stream_options.include_usag",
     "did you mean 'include_usage'"),
    ({"prompt": "a", "max_token": 5}, "max_token", "did you mean 'max_tokens'"),
    ({"prompt": "a", "logprobs": True}, "logprobs", "integer"),
    ({"prompt": "a", "logprobs": 6}, "logprobs", "[0, 5]"),
    ({"prompt": "a", "n": 0}, "n", ">= 1"),
    ({"prompt": "a", "best_of": 3}, "best_of", "must equal n"),
    ({"prompt": "a", "echo": True, "logprobs": 0}, "echo", "drop one"),
    ({"prompt": "a", "suffix": "z"}, "suffix", "not supported"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias['x']", "token ids"),
    ({"prompt": "a", "logit_bias": {"3": "big"}}, "logit_bias['3']", "finite number"),
    ({"prompt": "a", "seed": -1}, "seed", "in [0, 18446744073709551615]"),
])
def test_completion_bodies_are_checked_field_by_field(body, param, words):
    with pytest.raises(RequestError) as err:
        parse(body, CompletionBody)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message
    assert "\n" not in err.value.message


@pytest.mark.parametrize("body, param, words", [
    ({"messages": "x"}, "messages", "list of messages"),
    ({"messages": []}, "messages", "not be empty"),
    ({"messages": [{"role": "usr", "content": "x"}]}, "messages[0].role", "user"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "needs content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0].type", "not supported"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "non-empty"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice", "only 'auto' and 'none'"),
    ({"messages": MSG, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"messages": MSG, "logprobs": 1}, "logprobs", "boolean"),
    ({"messages": MSG, "audio": {"voice": "x"}}, "audio", "not supported"),
    ({"messages": MSG, "modalities": ["text", "audio"]}, "modalities", "only ['text']"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
])
def test_chat_bodies_are_checked_field_by_field(body, param, words):
    with pytest.raises(RequestError) as err:
        parse(body, ChatBody)
    assert err.value.param == param and words in err.value.message


def test_good_bodies_keep_what_they_say():
    b = parse({"prompt": [[1, 2], "x"], "n": 2, "stop": "\n", "logprobs": 2, "logit_bias": {"7": -100}}, CompletionBody)
    assert b.prompt == [[1, 2], "x"] and b.stop == ("\n",) and b.logit_bias == {7: -100.0} and b.top_logprobs == 2
    c = parse({"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}],
               "tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}],
               "max_completion_tokens": 7, "max_tokens": 3, "user": "u", "metadata": {"k": "v"}}, ChatBody)
    assert c.messages[0]["role"] == "system" and c.messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert c.template_tools is None and c.effective_max_tokens == 7


@pytest.mark.parametrize("stops, text, expected, hit", [
    (["."], "a.b.c", "a", True),
    (["END", "."], "xxEN", "xx", False),
    (["ab"], "zzab", "zz", True),
    ([], "a.b", "a.b", False),
])
def test_stop_text_whole(stops, text, expected, hit):
    s = StopText(stops)
    out, got = s.feed(text)
    assert (out, got) == (expected, hit)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["ab", "b", "a", "ba", "x", ".", "c."]), min_size=1, max_size=12),
       st.lists(st.sampled_from(["ab", "a.", "bab", "c"]), min_size=1, max_size=3))
def test_stop_text_pieces_equal_the_whole(pieces, stops):
    """However the text arrives, the emitted text is the text up to the first stop sequence."""
    whole = "".join(pieces)
    hits = [whole.find(s) for s in stops if s in whole]
    want = whole[: min(hits)] if hits else whole
    s, out, hit = StopText(stops), "", False
    for p in pieces:
        got, hit = s.feed(p)
        out += got
        if hit:
            break
    if not hit:
        out += s.flush()
    assert out == want and hit == bool(hits)


def test_admission_refuses_past_capacity_with_retry_after():
    a = Admission(capacity=3, batch=2)
    t1, t2 = a.admit(2), a.admit(1)
    with pytest.raises(Overloaded) as err:
        a.admit(1)
    assert err.value.status == 503 and 1 <= int(err.value.headers()["Retry-After"]) <= 60
    t1.release()
    t1.release()  # idempotent
    assert a.held == 1
    a.admit(2).release()
    t2.release()
    assert a.held == 0 and a.refused == 1


class _Cache:
    """A compressed layer cache as the prompt cache sees it: trims nothing, has bytes."""

    nbytes = 100

    def can_trim(self, n):
        return n == 0

    def is_trimmable(self):
        return True


class _Full(_Cache):
    """mlx-lm's full cache: trims anything."""

    can_trim = None


def _entry():
    return [_Cache(), _Cache()]


def test_each_sequence_keeps_its_prompt_entry_within_the_size():
    """8 requests leave 2 entries each (the prompt before its answer, and the whole); with
    max_size 10 all 16 stay (8 sequences), and each prompt again prefills its last token only."""
    pc = CompressedPromptCache(max_size=10)
    prompts = [[i, 100 + i, 200 + i, 300 + i] for i in range(8)]
    for p in prompts:
        pc.insert_cache("m", p[:-1], _entry())
    for p in prompts:
        pc.insert_cache("m", p + [9, 9], _entry())
    assert len(pc) == 16 and pc.sequences() == 8 and pc.nbytes == 16 * 200
    for p in prompts:
        cache, rest = pc.fetch_nearest_cache("m", p)
        assert cache is not None and rest == p[-1:]
    cache, rest = pc.fetch_nearest_cache("m", prompts[0] + [9, 9, 5])  # the conversation goes on
    assert rest == [5]


def test_the_least_recently_used_go_first():
    pc = CompressedPromptCache(max_size=2)
    for i in range(3):
        pc.insert_cache("m", [i, 1], _entry())
        pc.insert_cache("m", [i, 1, 2, 3], _entry())
    assert pc.sequences() == 2 and len(pc) == 4
    assert pc.fetch_nearest_cache("m", [0, 1, 2])[0] is None  # sequence 0 left first
    assert pc.fetch_nearest_cache("m", [1, 1, 2, 3, 7])[1] == [7]  # sequence 1 goes on: now the most recent
    pc.insert_cache("m", [5, 1, 2], _entry())
    assert pc.fetch_nearest_cache("m", [1, 1, 2, 3, 4])[1] == [4]
    # the least recent sequence left, then its prompt entry (a sequence of its own once alone)
    assert pc.fetch_nearest_cache("m", [2, 1, 2, 3, 4]) == (None, [2, 1, 2, 3, 4])
    assert pc.sequences() == 2 and len(pc) == 3


def test_bytes_bound_every_entry():
    pc = CompressedPromptCache(max_size=100, max_bytes=1000)
    for i in range(8):
        pc.insert_cache("m", [i, i], _entry())
    assert pc.nbytes <= 1000 and len(pc) == 5
    pc.trim_to(n_bytes=300)
    assert pc.nbytes <= 300


def test_full_caches_keep_mlx_lm_behaviour():
    """A plain mlx-lm cache serves its prefixes by trimming: a longer entry replaces them."""
    pc = CompressedPromptCache(max_size=10)
    pc.insert_cache("m", [1, 2], [_Full()])
    pc.insert_cache("m", [1, 2, 3, 4], [_Full()])
    assert len(pc) == 1


def test_the_parser_has_mlx_lm_flags_and_ours():
    from kvcompress.serve.options import parse_server_args, server_parser

    args = parse_server_args(["--model", "m", "--prompt-cache-bytes", "1G", "--max-concurrent-requests", "5",
                              "--decode-concurrency", "4", "--chat-template-args", '{"a": 1}'])
    assert args.prompt_cache_bytes == 10**9 and args.max_concurrent_requests == 5
    assert args.chat_template_args == {"a": 1} and args.prompt_cache_size == 10
    text = server_parser().format_help()
    for flag in ("--draft-model", "--trust-remote-code", "--prefill-step-size", "--allowed-origins", "--pipeline",
                 "--max-concurrent-requests", "--prompt-cache-size"):
        assert flag in text
    with pytest.raises(SystemExit):
        parse_server_args(["--max-concurrent-requests", "0"])
