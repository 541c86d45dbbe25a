"""kvjax.corpus: the manifest's sources (stdlib, pydoc, both) and the errors that name the fix."""

import json
import sysconfig

import numpy as np
import pytest

from kvjax.corpus import CorpusError, check_source, manifest_files, read_tokens


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
