"""Real text, a tokenizer trained offline, packing, and global batches that resume exactly.

Also: Hugging Face Llama and BERT, built from configurations, trained on that text by
the engine over real gloo processes, match single-device training.
"""

import functools

import pytest
import torch

import poplar
from poplar.data.text import EOT, GlobalBatches, embedded_text, load_text, pack, train_tokenizer
from poplar.processes.spawn import spawn
from poplar.models.hf import HF_PRESETS, build_hf_model, masked_positions
from tests.data.workers import reference, train_hf


@pytest.fixture(autouse=True)
def data_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))


def test_embedded_text_is_real_prose_from_the_python_installation():
    docs = embedded_text()
    text = "\n".join(docs)
    assert len(text) > 300_000
    assert "Assert statements are a convenient way" in text
    assert len(set(text.split())) > 5_000          # a real vocabulary, not random tokens


def test_tokenizer_is_trained_offline_round_trips_and_is_cached(tmp_path):
    docs = embedded_text()
    tok = train_tokenizer(docs, 1024)
    assert tok.get_vocab_size() == 1024 and tok.token_to_id(EOT) is not None
    sample = docs[3][:500]
    assert tok.decode(tok.encode(sample).ids) == sample
    cached = list((tmp_path / "data-cache").glob("tokenizer-*.json"))
    assert len(cached) == 1
    assert train_tokenizer(docs, 1024).to_str() == tok.to_str()     # read back from the cache


def test_packing_makes_shifted_fixed_length_sequences():
    docs = embedded_text()[:5]
    tok = train_tokenizer(docs, 300)
    seqs = pack(docs, tok, 16)
    assert seqs.shape[1] == 17 and seqs.dtype == torch.long
    ids = [i for enc in tok.encode_batch(docs) for i in enc.ids + [tok.token_to_id(EOT)]]
    assert seqs.flatten().tolist() == ids[: seqs.numel()]
    with pytest.raises(ValueError, match="fewer than one sequence"):
        pack(["hi"], tok, 10_000)


def test_global_batches_are_deterministic_resumable_and_sliced_by_the_plan():
    seqs = torch.arange(50 * 5).view(50, 5)
    a, b = GlobalBatches(seqs, 8, seed=1), GlobalBatches(seqs, 8, seed=1)
    run = [a.batch(k) for k in range(14)]                   # past the end of an epoch (6 batches)
    assert torch.equal(b.batch(9), run[9])                  # a resumed run sees the same batch
    assert not torch.equal(GlobalBatches(seqs, 8, seed=2).batch(0), run[0])
    epoch = torch.cat(run[:6])
    assert len(set(epoch[:, 0].tolist())) == 48             # no sequence twice within an epoch
    assert not torch.equal(run[0], run[6])                  # the next epoch is shuffled anew
    plan = poplar.Plan.from_local_batches(1, [5, 2, 1], [2, 1, 1])
    parts = [GlobalBatches(seqs, 8, seed=1).local(3, plan, r) for r in range(3)]
    assert torch.equal(torch.cat([x for x, _ in parts]), run[3][:, :-1])
    assert torch.equal(torch.cat([y for _, y in parts]), run[3][:, 1:])
    with pytest.raises(ValueError, match="larger than the 50 sequences"):
        GlobalBatches(seqs, 51)


def test_local_text_files_load_through_datasets(tmp_path):
    (tmp_path / "a.txt").write_text("First paragraph of a file.\n\nSecond paragraph here.\n")
    (tmp_path / "b.txt").write_text("Another file, one paragraph.\n")
    docs = load_text(str(tmp_path))
    assert any("Second paragraph" in d for d in docs) and any("Another file" in d for d in docs)
    with pytest.raises(FileNotFoundError, match="embedded"):
        load_text(str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("content, words", [
    (b"text, then \x00\x01 bytes", "is a binary file, not text (byte 11 is NUL): give UTF-8 text files"),
    ("café au lait\n".encode("latin-1"), "is not UTF-8 text (byte 3 is 0xe9): convert it to UTF-8"),
    ("fine, then a cut \u20ac".encode()[:-1], "is not UTF-8 text (it ends inside a character)"),
    (b"", "the text is empty"),
    (b" \n\n \n", "the text is empty"),
])
def test_a_file_that_is_not_text_is_refused_in_one_line_naming_it(tmp_path, content, words):
    (tmp_path / "data.txt").write_bytes(content)
    with pytest.raises(ValueError) as e:
        load_text(str(tmp_path / "data.txt"))
    assert words in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "good.txt").write_text("A paragraph of fine text.\n")
    if content.strip():   # in a directory: the bad file among good ones, named (an empty one is left out)
        with pytest.raises(ValueError, match=f"{tmp_path / 'data.txt'} is"):
            load_text(str(tmp_path))


def test_a_damaged_tokenizer_cache_is_trained_again(tmp_path):
    docs = embedded_text()[:40]
    tok = train_tokenizer(docs, 300)
    (cached,) = (tmp_path / "data-cache").glob("tokenizer-*.json")
    cached.write_text('{"version": "1.0", "trunc')
    assert train_tokenizer(docs, 300).to_str() == tok.to_str()


def test_masked_positions_are_the_same_count_per_sequence_and_reproducible():
    tokens = torch.randint(0, 100, (4, 40))
    pos = masked_positions(tokens)
    assert pos.shape == (4, 6) and torch.equal(pos, masked_positions(tokens.clone()))
    assert all(len(set(row.tolist())) == 6 for row in pos)


def test_presets_build_without_a_download():
    for name in ("llama-tiny", "bert-tiny"):
        model = build_hf_model(name, vocab_size=300)
        assert sum(p.numel() for p in model.parameters()) > 10_000
    with pytest.raises(ValueError, match="choose one of"):
        build_hf_model("gpt-5", 300)
    assert {"llama-125m", "llama-350m", "bert-base"} <= set(HF_PRESETS)


STEPS = 2
# (stage, micro_batch_sizes, accum_steps, local_batch_sizes): uneven, near-equal micro-batches
HF_PLANS = [(0, [3, 1], [2, 2], [5, 2]), (1, [4, 2], [1, 2], [4, 3]), (2, [3, 1], [2, 2], [6, 2]),
            (3, [2, 2], [2, 2], [4, 3])]


@functools.cache
def hf_results(name):
    plans = [{"zero_stage": s, "micro_batch_sizes": m, "accum_steps": a, "local_batch_sizes": b}
             for s, m, a, b in HF_PLANS]
    return spawn(train_hf, 2, name, plans, STEPS, timeout_s=240)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
@pytest.mark.parametrize("index", range(len(HF_PLANS)))
def test_hf_models_on_text_match_single_device_training(name, index):
    got = hf_results(name)[index]
    ref_state, ref_losses = reference(name, sum(HF_PLANS[index][3]), STEPS)
    assert got["losses"] == pytest.approx(ref_losses, abs=1e-5)
    for key, ref in ref_state.items():
        torch.testing.assert_close(got["state"][key], ref, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
