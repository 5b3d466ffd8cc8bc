"""The long-context workload's task generators, scoring, filler text and chat turns (no model).

With a byte-level tokenizer: the episodes are seeded, exactly the requested length, their facts
are where they are said to be (characters and tokens) and their answers checkable; scoring
counts whole words and numbers, partial match counts the longest run found; the filler comes
from any folder of .txt files (or the package's own docstrings) with special-token strings
defused; the chat pieces concatenate to what the template renders.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from _longctx_helpers import ByteTokenizer, text_source
from kvcompress.bench.longctx_tasks import TASKS, build_episode, score, task_plants
from kvcompress.bench.longctx_text import ChatFormat, TextSource

ALL_TASKS = tuple(TASKS)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return text_source(tmp_path_factory)


# ------------------------------------------------------------------------------------------
# Task generators and scoring
# ------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
# found by hypothesis: two plants of the chain took crossing places (VAR C read before VAR B)
@example(seed=17790420, length=4011, chatml=True, tasks=["niah_multikey", "qa", "vt"])
@given(seed=st.integers(0, 2**31), length=st.integers(2000, 5000), chatml=st.booleans(),
       tasks=st.lists(st.sampled_from(ALL_TASKS), min_size=1, max_size=3, unique=True))
def test_episode_is_seeded_exact_length_with_facts_where_said(source, seed, length, chatml, tasks):
    tok = ByteTokenizer(chatml)
    fmt = ChatFormat.for_tokenizer(tok)
    ep = build_episode(tok, fmt, source, length, tasks, (seed, 1))
    assert ep == build_episode(tok, fmt, source, length, tasks, (seed, 1))  # seeded
    assert abs(ep.n_tokens - length) <= 2
    assert list(ep.prefix_ids[: len(fmt.head_ids(tok))]) == fmt.head_ids(tok)
    for task, text, char_start, tok_start in ep.placed:
        assert ep.document[char_start:].startswith(text)
        assert tok.decode(ep.prefix_ids[tok_start : tok_start + len(text)]) == text  # the needle is at its token
    for q, depth in zip(ep.questions, ep.depths):
        assert q.task in tasks and q.refs and 0.0 <= depth <= 1.0
        planted = " ".join(ep.placed[i][1] for i in q.plants)
        # every reference is in the facts the question points at, and a reply quoting them scores 1
        assert all(r in planted for r in q.refs)
        assert score(" ".join(q.refs), q.refs) == (1.0, 1.0)
        assert not any(r in q.text + q.answer_prefix for r in q.refs) or q.task == "vt"
    chain = [t for t in ep.placed if t[0] == "vt"]
    assert [c[2] for c in chain] == sorted(c[2] for c in chain)  # assignments in reading order


def test_task_draws_differ_by_seed_and_keys_are_distinct():
    a = task_plants(ALL_TASKS, np.random.default_rng(1))
    b = task_plants(ALL_TASKS, np.random.default_rng(2))
    assert a != b
    refs = [r for q in a[1] for r in q.refs if q.task in ("niah_single", "niah_multikey", "niah_multivalue")]
    assert len(refs) == len(set(refs))


def test_separate_gives_each_task_its_own_contexts(source):
    from kvcompress.bench.longctx import DEFAULTS, make_episodes

    tok = ByteTokenizer(chatml=True)
    s = {**DEFAULTS, "tasks": ("niah_single", "qa"), "episodes": 2}
    shared = make_episodes(tok, ChatFormat.for_tokenizer(tok), source, s, 2500)
    apart = make_episodes(tok, ChatFormat.for_tokenizer(tok), source, {**s, "separate": True}, 2500)
    assert len(shared) == 2 and {q.task for q in shared[0].questions} == {"niah_single", "qa"}
    assert len(apart) == 4 and [{q.task for q in ep.questions} for ep in apart] == [
        {"niah_single"}, {"niah_single"}, {"qa"}, {"qa"}]
    assert all(ep.n_tokens == 2500 for ep in shared + apart)


def test_unknown_task_and_too_short_context_are_clear_errors(source):
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        task_plants(["nope"], np.random.default_rng(0))
    with pytest.raises(ValueError, match="too short for the planted facts"):
        build_episode(tok, ChatFormat.for_tokenizer(tok), source, 120, ALL_TASKS, (0,))


@pytest.mark.parametrize("answer, refs, exact, partial", [
    (" 130414.", ["130414"], 1.0, 1.0),
    (" 130.", ["130414"], 0.0, 0.5),             # part of the code
    (" 1304145", ["130414"], 0.0, 1.0),          # a longer number is not the answer (all its digits are)
    (" 7 and 130414", ["130414", "999999"], 0.0, 0.5),
    ("Dunmere, the town", ["dunmere"], 1.0, 1.0),  # case-insensitive whole word
    ("Dunmeres", ["Dunmere"], 0.0, 1.0),
    ("", ["42"], 0.0, 0.0),
])
def test_score_exact_and_partial(answer, refs, exact, partial):
    assert score(answer, refs) == (exact, pytest.approx(partial))


def test_score_needs_a_reference():
    with pytest.raises(ValueError, match="at least one reference"):
        score("x", [])


# ------------------------------------------------------------------------------------------
# Text and chat turns
# ------------------------------------------------------------------------------------------


def test_text_source_reads_txt_recursively_and_refuses_bad_folders(source, tmp_path):
    assert sorted(n for n, _ in source.docs) == ["a.txt", "sub/b.txt"]
    text, used = source.filler(np.random.default_rng(0), 5000)
    assert len(text) >= 5000 and set(used) <= {"a.txt", "sub/b.txt"}
    with pytest.raises(ValueError, match="no such folder"):
        TextSource.from_dir(tmp_path / "absent")
    with pytest.raises(ValueError, match="no .txt files"):
        TextSource.from_dir(tmp_path)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        TextSource.from_dir(tmp_path)


def test_embedded_text_is_real_prose_when_no_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOMPRESS_DATA_DIR", str(tmp_path))  # no longtext there
    src = TextSource.from_dir(None)
    assert src.where.startswith("embedded") and src.total_chars() > 20_000
    with pytest.raises(ValueError, match="--text-dir"):
        TextSource.from_dir(None, allow_embedded=False)


def test_filler_defuses_special_token_strings(tmp_path):
    (tmp_path / "x.txt").write_text("See <filename> and <|im_end|> here. " * 50)
    text, _ = TextSource.from_dir(tmp_path).filler(np.random.default_rng(0), 500, ["<|im_end|>", "<filename>"])
    assert "<filename>" not in text and "<|im_end|>" not in text and "filename" in text


def test_chat_turns_concatenate_to_the_rendered_conversation():
    """head + context + first question + reply + later question ... is exactly what the template
    renders for that conversation (with the answer prefixes as the start of each reply)."""
    tok = ByteTokenizer(chatml=True)
    fmt = ChatFormat.for_tokenizer(tok)
    text = fmt.head + "CTX" + fmt.first_question("Q1?", "P1") + " A1" + fmt.later_question("Q2?", "P2")
    want = tok.apply_chat_template([{"role": "user", "content": "CTX\n\nQ1?"},
                                    {"role": "assistant", "content": "P1 A1"}, {"role": "user", "content": "Q2?"}])
    assert text == want + "P2"
    plain = ChatFormat.for_tokenizer(tok, chat_template=False)
    assert not plain.templated and plain.head_ids(tok) == [tok.bos_token_id]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    class Rewriting(ByteTokenizer):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
            return f"[{len(messages)}]" + super().apply_chat_template(messages, tokenize, add_generation_prompt)

    with pytest.raises(ValueError, match="--no-chat-template"):
        ChatFormat.for_tokenizer(Rewriting(chatml=True))




@pytest.mark.parametrize("length", [1000, 4096])
def test_real_tokenizer_episodes_have_the_length_and_the_facts(length):
    """With SmolLM2's byte-level BPE (the tokenizer alone; skipped when absent): the prefix is
    within a few tokens of the length asked, and each fact's tokens spell it."""
    from conftest import data_dir, models_dir

    path = models_dir() / "smollm2-135m-instruct"
    if not (path / "tokenizer.json").is_file() or not (data_dir() / "longtext").is_dir():
        pytest.skip(f"SmolLM2's tokenizer ({path}) or the long text ({data_dir() / 'longtext'}) is absent")
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(path)
    fmt = ChatFormat.for_tokenizer(tok)
    src = TextSource.from_dir(data_dir() / "longtext")
    for seed in range(2):
        ep = build_episode(tok, fmt, src, length, ALL_TASKS, (seed, length))
        assert abs(ep.n_tokens - length) <= 3
        for _, text, _, t in ep.placed:
            n = len(tok.encode(" " + text, add_special_tokens=False))
            got = tok.decode(list(ep.prefix_ids[t : t + n + 2]))
            assert got.lstrip().startswith(text), (got, text)  # the fact starts at its token (a space may merge)


def test_no_question_contains_its_own_answer():
    """An invented answer can be part of its own question (a town inside a person's name, a pet
    name inside an owner's): such draws are redrawn (seeds 27, 129, 557 ... did it before)."""
    for seed in range(2000):
        _, qs = task_plants(["qa"], np.random.default_rng(seed))
        for q in qs:
            assert not any(r in q.text + q.answer_prefix for r in q.refs), (seed, q)
