"""kvjax.corpus: the manifest's sources (stdlib, pydoc, both), datasets (hf: a hub name or a local copy, streamed,
split, cached) and the errors that name the fix."""

import dataclasses
import io
import json
import os
import shutil
import sysconfig
import time

import numpy as np
import pytest

from kvjax import corpus
from kvjax.corpus import (PARTS, CorpusError, Split, check_source, hub_problem, hub_unreachable, is_heldout,
                          manifest_files, read_tokens)


class Chars:  # a tokenizer stand-in: one id per character
    def encode_batch(self, docs, add_special_tokens=False):
        return [type("E", (), {"ids": [ord(c) for c in d]})() for d in docs]


def manifest(tmp_path, docs_root):
    files = [{"path": "stdlib/this.py", "sha256": "b", "split": "train"},
             {"path": "stdlib/antigravity.py", "sha256": "d", "split": "heldout"},
             {"path": "pydoc/a.rst.txt", "sha256": "a", "split": "train"},
             {"path": "pydoc/b.rst.txt", "sha256": "c", "split": "train"}]
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"sources": {"stdlib": {"root": "/elsewhere"}, "pydoc": {"root": str(docs_root)}},
                                "files": files}))
    return str(path)


def test_manifest_sources_read_their_split_in_recorded_order(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.rst.txt").write_text("Prose A.")
    (docs / "b.rst.txt").write_text("Prose B.")
    m = manifest(tmp_path, docs)
    stdlib = sysconfig.get_paths()["stdlib"]
    assert manifest_files(m, "pydoc", "train") == [str(docs / "a.rst.txt"), str(docs / "b.rst.txt")]
    assert manifest_files(m, "stdlib", "train") == [f"{stdlib}/this.py"]  # this Python's, not the recorded root
    assert manifest_files(m, "corpus", "train") == [str(docs / "a.rst.txt"), f"{stdlib}/this.py",
                                                    str(docs / "b.rst.txt")]  # by sha256: a, b, c
    tokens = read_tokens(["pydoc:train"], Chars(), 0, 100, m)
    np.testing.assert_array_equal(tokens, [ord(c) for c in "Prose A."] + [0] + [ord(c) for c in "Prose B."] + [0])
    both = read_tokens(["corpus:train"], Chars(), 0, 10_000, m)
    assert len(both) > len(tokens) and both[:9].tolist() == tokens[:9].tolist()


def test_missing_documentation_and_bad_sources_name_the_fix(tmp_path):
    m = manifest(tmp_path, tmp_path / "not-installed")
    for source in ("pydoc:train", "corpus:train"):  # a mix refuses a missing part rather than read half of it
        with pytest.raises(CorpusError, match="apt-get install -y python3.11-doc"):
            check_source(source, m)
    check_source("stdlib:train", m)
    with pytest.raises(CorpusError, match="the split must be one of"):
        check_source("pydoc:valid", m)
    with pytest.raises(CorpusError, match="corpus:train"):
        check_source("docs:train", m)


# ---- hf: datasets (a hub name or a local copy, through one reader) -------------------------------------------------

FIELDS = ("text", "id", "dump", "url", "file_path", "language", "language_score", "token_count", "score", "int_score")


def fineweb_like(texts):
    """A `datasets.Dataset` in FineWeb-Edu's layout (its fields, in its order) holding `texts`."""
    import datasets
    n = len(texts)
    return datasets.Dataset.from_dict({
        "text": list(texts), "id": [f"<urn:uuid:{i:08d}>" for i in range(n)], "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{i}" for i in range(n)], "file_path": ["made-here.warc.gz"] * n,
        "language": ["en"] * n, "language_score": [0.9] * n, "token_count": [len(t) // 4 for t in texts],
        "score": [3.0] * n, "int_score": [3] * n})


def fineweb_repo(root, texts) -> str:
    """`texts` laid out as FineWeb-Edu's repository lays out sample-10BT (parquet files under sample/10BT/), with a
    README that names that config alone; the hf: source that reads the directory as the hub name is read."""
    ds = fineweb_like(texts)
    repo = os.path.join(root, "fineweb-edu")
    os.makedirs(os.path.join(repo, "sample", "10BT"))
    half = len(texts) // 2  # two files, read in name order, as the hub's 000_00000.parquet, 001_00000.parquet
    ds.select(range(half)).to_parquet(os.path.join(repo, "sample", "10BT", "000_00000.parquet"))
    ds.select(range(half, len(texts))).to_parquet(os.path.join(repo, "sample", "10BT", "001_00000.parquet"))
    with open(os.path.join(repo, "README.md"), "w") as f:
        f.write("---\nconfigs:\n- config_name: sample-10BT\n  data_files:\n  - split: train\n"
                "    path: sample/10BT/*\n---\n")
    return f"hf:{repo}:sample-10BT:train"


def write_copies(root, texts) -> dict:
    """The same documents as each local layout an hf: source reads: a download of a hub repository, a save_to_disk
    directory, a saved DatasetDict, a .jsonl file and a glob of parquet files."""
    ds = fineweb_like(texts)
    repo = fineweb_repo(str(root), texts)
    ds.save_to_disk(str(root / "saved"))
    import datasets
    datasets.DatasetDict({"train": ds}).save_to_disk(str(root / "saved_dict"))
    ds.to_json(str(root / "copy.jsonl"))
    return {"repo": repo, "saved": f"hf:{root / 'saved'}", "saved_dict": f"hf:{root / 'saved_dict'}::train",
            "jsonl": f"hf:{root / 'copy.jsonl'}", "parquet_glob": f"hf:{root}/fineweb-edu/sample/10BT/*.parquet"}


def prose(n, seed=0):
    rng = np.random.default_rng(seed)
    words = "the a river town light reads answers cache map layer stone field north quiet".split()
    return [f"Document {i}. " + " ".join(rng.choice(words, int(rng.integers(5, 30)))) for i in range(n)]


def texts_of(tokens, eos=0):
    """The documents of a Chars token array (EOS-separated)."""
    return [t for t in "".join(chr(c) if c != eos else "\x00" for c in tokens).split("\x00") if t]


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    texts = prose(120)
    return texts, write_copies(tmp_path_factory.mktemp("copies"), texts)


def test_every_local_layout_reads_as_the_hub_does_and_the_parts_never_share_a_document(copies, tmp_path):
    texts, where = copies
    for source in where.values():
        check_source(source, "")
    got = {}
    for name, source in where.items():
        parts = {part: read_tokens([source], Chars(), 0, 10 ** 6, split=Split(part=part)) for part in PARTS}
        got[name] = parts
        train, held = texts_of(parts["train"]), texts_of(parts["heldout"])
        assert set(train).isdisjoint(held) and sorted(train + held) == sorted(texts), name
        assert train == [t for t in texts if t in set(train)]  # in the dataset's order
        assert held == [t for t in texts if is_heldout(t, 0.2, 0)]
    for name, parts in got.items():  # one reader: every layout gives the same tokens
        for part in PARTS:
            np.testing.assert_array_equal(parts[part], got["repo"][part], err_msg=name)
    assert 0.1 < len(texts_of(got["repo"]["heldout"])) / len(texts) < 0.3  # about heldout_share
    other = texts_of(read_tokens([where["repo"]], Chars(), 0, 10 ** 6, split=Split(part="heldout", split_seed=1)))
    assert other != texts_of(got["repo"]["heldout"])  # another seed, another split


def test_the_stream_stops_at_the_tokens_asked_for_and_a_rerun_reads_the_cache(copies, tmp_path, monkeypatch):
    texts, where = copies
    train = [t for t in texts if not is_heldout(t, 0.2, 0)]
    cost = np.cumsum([len(t) + 1 for t in train])  # Chars: one token a character, and the EOS
    budget = int(cost[9]) - 3  # the 10th calibration document reaches it
    last = texts.index(train[9]) + 1  # records read up to it, held-out ones included
    split = Split(part="train", cache_dir=str(tmp_path / "corpus"), tokenizer_id="chars")
    tokens = read_tokens([where["saved"]], Chars(), 0, budget, batch=1, split=split)
    assert len(tokens) == budget and texts_of(tokens)[:9] == train[:9]
    record = split.cached(where["saved"], "text", budget)
    assert record["records_read"] == last and record["documents"] == 10 and not record["exhausted"]
    read_tokens([where["jsonl"]], Chars(), 0, budget, batch=4, split=split)  # batches stop where the budget may be
    record = split.cached(where["jsonl"], "text", budget)
    assert record["documents"] == 10 and record["records_read"] == last
    read_tokens([where["repo"]], Chars(), 0, budget, batch=64, split=split)
    assert split.cached(where["repo"], "text", budget)["records_read"] == last

    def no_dataset(ds):
        raise AssertionError(f"{ds.source} was read again")
    monkeypatch.setattr(corpus, "_open", no_dataset)
    np.testing.assert_array_equal(read_tokens([where["saved"]], Chars(), 0, budget, batch=1, split=split), tokens)
    with pytest.raises(CorpusError, match="read again"):  # more than the cache holds: read again
        read_tokens([where["saved"]], Chars(), 0, budget + 100, batch=1, split=split)
    with open(split.cache_file(where["jsonl"], "text") + ".json", "w") as f:
        f.write("{half a record")  # not a record it wrote: no cache
    assert split.cached(where["jsonl"], "text", budget) is None
    with pytest.raises(CorpusError, match="read again"):  # another tokenizer: its own cache
        read_tokens([where["saved"]], Chars(), 0, budget, split=dataclasses.replace(split, tokenizer_id="other"))


def test_a_hub_dataset_is_refused_offline_unless_the_run_cached_it(copies, tmp_path, monkeypatch):
    texts, where = copies
    hub = "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train"
    reads = [("data.train_text", "train", (hub,), 500), ("data.heldout_text", "heldout", (hub,), 200)]
    cache = Split(cache_dir=str(tmp_path / "corpus"), tokenizer_id="chars")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    why = hub_problem(reads, "text", cache)
    assert time.perf_counter() - start < 0.5
    assert why.startswith(f"{hub} (data.train_text and data.heldout_text) must be streamed from the Hugging Face "
                          "hub, but HF_HUB_OFFLINE=1 is set")
    assert "--config.data.train_text=hf:/path/to/copy --config.data.heldout_text=hf:/path/to/copy" in why
    assert "--config.data.train_text=stdlib:train --config.data.heldout_text=stdlib:heldout" in why
    assert "\n" not in why
    assert hub_problem([(f, p, (where["repo"],), n) for f, p, _, n in reads], "text", cache) is None  # local
    # the hub's stream, stood in for by the local copy: read once, the rerun needs no hub
    real_open = corpus._open
    monkeypatch.setattr(corpus, "_open", lambda ds: real_open(corpus.dataset(where["repo"])))
    for _, part, _, n in reads[:1]:
        read_tokens([hub], Chars(), 0, n, split=dataclasses.replace(cache, part=part))
    assert "(data.heldout_text)" in hub_problem(reads, "text", cache)  # the held-out part is not cached yet
    read_tokens([hub], Chars(), 0, 200, split=dataclasses.replace(cache, part="heldout"))
    assert hub_problem(reads, "text", cache) is None
    monkeypatch.setattr(corpus, "_open", lambda ds: pytest.fail("the hub was read"))
    read_tokens([hub], Chars(), 0, 500, split=dataclasses.replace(cache, part="train"))


def test_without_network_the_probe_answers_within_its_time(monkeypatch):
    for var in corpus.OFFLINE:
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # a name that never resolves
    assert "hub.invalid:443 cannot be reached" in hub_unreachable()
    monkeypatch.setattr(corpus.socket, "create_connection", lambda *a, **k: time.sleep(5))  # a silent network
    start = time.perf_counter()
    assert hub_unreachable(0.3) == "hub.invalid:443 did not answer within 0.3 s"
    assert time.perf_counter() - start < 1.0
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert "proxy.invalid:3128 (the proxy for hub.invalid) did not answer" in hub_unreachable(0.3)
    monkeypatch.setattr(corpus.socket, "create_connection", lambda *a, **k: io.BytesIO())  # connects
    assert hub_unreachable(0.3) is None


def test_bad_dataset_sources_name_the_fix(copies, tmp_path):
    texts, where = copies
    with pytest.raises(CorpusError, match=r"expected hf:NAME\[:CONFIG\[:SPLIT\]\]"):
        check_source("hf:a:b:c:d", "")
    with pytest.raises(CorpusError, match="no such dataset directory or data files"):
        check_source(f"hf:{tmp_path}/missing", "")
    with pytest.raises(CorpusError, match=r"has splits \['train'\], not 'test'"):
        check_source(where["saved_dict"].replace("::train", "::test"), "")
    with pytest.raises(CorpusError, match="drop 'sample-10BT'"):
        check_source(where["saved"] + ":sample-10BT", "")
    with pytest.raises(CorpusError, match=r"record 1 has no 'body' field \(fields: \['dump', 'file_path'"):
        read_tokens([where["saved"]], Chars(), 0, 100, text_field="body")
    with pytest.raises(CorpusError, match="reading the local copy failed: ValueError: .*nosuch"):
        read_tokens([where["repo"].replace("sample-10BT", "nosuch")], Chars(), 0, 100)
    # a partial download of the hub repository: its README's first config names files that are not here
    partial = tmp_path / "partial"
    shutil.copytree(where["repo"][len("hf:"):].split(":")[0], partial)
    (partial / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
                                       "    path: data/*/*\n- config_name: sample-10BT\n  data_files:\n"
                                       "  - split: train\n    path: sample/10BT/*\n---\n")
    with pytest.raises(CorpusError, match=r"name its data files instead, e.g. hf:.*partial/sample/10BT/\*.parquet"):
        read_tokens([f"hf:{partial}:sample-10BT:train"], Chars(), 0, 100)
    tokens = read_tokens([f"hf:{partial}/sample/10BT/*.parquet"], Chars(), 0, 100)  # as the message says
    np.testing.assert_array_equal(tokens, read_tokens([where["repo"]], Chars(), 0, 100))


def test_the_calibrate_hash_covers_the_dataset_and_old_runs_keep_theirs(copies, tmp_path):
    from kvjax import config_flags
    from kvjax.run.config import RunConfig
    from kvjax.job.stages import plan
    texts, where = copies
    models = [("source.path", "checkpoints/toy/source"), ("target.path", "checkpoints/toy/pruned")]

    def calibrate(name, *overrides):
        return plan(config_flags.build(name, [*models, *overrides], RunConfig))["calibrate"]
    old = calibrate("toy")
    assert "corpus" not in old.settings and "heldout_share" not in old.settings["data"]  # as before: same hash
    assert calibrate("toy", ("data.split_seed", "1")).hash != old.hash
    real = calibrate("qwen32_8")
    assert real.settings["corpus"] == {"hf:HuggingFaceFW/fineweb-edu:sample-10BT:train": {}}
    texts_flag = [("data.train_text", where["jsonl"]), ("data.heldout_text", where["jsonl"])]
    local = calibrate("qwen32_8", *texts_flag)
    path = where["jsonl"][len("hf:"):]
    assert local.settings["corpus"][where["jsonl"]][path][0] == os.path.getsize(path)
    os.utime(path, ns=(1, 1))  # the same path, other contents (as far as a listing can tell): recalibrate
    assert calibrate("qwen32_8", *texts_flag).hash != local.hash
