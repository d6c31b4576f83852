"""The download cache: --dir, then GPT2NP_CACHE, then the user cache dir; a file counts as done only
with a matching size and SHA-256 record; an interrupted download (a fake opener)
never lands as done."""
import hashlib
import io
import urllib.request

import pytest

from gpt2np.cli import fetch as fetch_cli
from gpt2np.datasets import cache
from gpt2np.datasets.cache import CachedFile, cache_dir, cached, is_done, mark_done, record_path
from gpt2np.datasets.fetch import FetchError
from gpt2np.errors import BadInput

BODY = b"".join(b'{"line": %d}\n' % i for i in range(5000))      # ~70 kB: several chunks
URL = "https://example.invalid/hellaswag_val.jsonl"


class Response(io.BytesIO):
    """urlopen's response: headers, read(n); `cut` ends it early, `reset` raises mid-way."""

    def __init__(self, body, length=None, reset_after=None):
        super().__init__(body)
        self.headers = {"Content-Length": str(len(body) if length is None else length)}
        self.reset_after = reset_after

    def read(self, n=-1):
        if self.reset_after is not None and self.tell() >= self.reset_after:
            raise ConnectionResetError(104, "Connection reset by peer")
        return super().read(n)


def opener(body=BODY, **kw):
    calls = []

    def open_(request, timeout=None):
        calls.append(request.full_url)
        return Response(body, **kw)
    open_.calls = calls
    return open_


def test_cache_dir_order(tmp_path, monkeypatch):
    monkeypatch.delenv("GPT2NP_CACHE", raising=False)
    platformdirs = pytest.importorskip("platformdirs")
    assert cache_dir() == cache.Path(platformdirs.user_cache_dir("gpt2np", appauthor=False))
    monkeypatch.setenv("GPT2NP_CACHE", str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "flag") == tmp_path / "flag"


def test_download_is_recorded_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2NP_CACHE", str(tmp_path))
    good = opener()
    entry = CachedFile("f.jsonl", URL, size=len(BODY), sha256=hashlib.sha256(BODY).hexdigest())
    path = cached(entry, progress=False, opener=good)
    assert path == tmp_path / "f.jsonl" and path.read_bytes() == BODY and is_done(path, len(BODY))
    # not downloaded again
    assert cached(entry, progress=False, opener=good) == path and len(good.calls) == 1


@pytest.mark.parametrize("broken", [dict(length=len(BODY) * 2), dict(reset_after=len(BODY) // 2)],
                         ids=["closed-early", "connection-reset"])
def test_interrupted_download_never_counts_as_done(tmp_path, broken):
    entry = CachedFile("f.jsonl", URL)
    with pytest.raises(FetchError, match="could not download"):
        cached(entry, tmp_path, progress=False, opener=opener(**broken))
    # no partial file, no record, no temp file
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert cached(entry, tmp_path, progress=False, opener=opener()).read_bytes() == BODY


def test_a_partial_or_changed_file_is_downloaded_again(tmp_path):
    entry = CachedFile("f.jsonl", URL)
    path = tmp_path / "f.jsonl"
    # a partial copy without a record: not done
    path.write_bytes(BODY[:1000])
    assert not is_done(path)
    good = opener()
    assert (cached(entry, tmp_path, progress=False, opener=good).read_bytes() == BODY
            and len(good.calls) == 1)
    # same size, other bytes: the hash says not done
    path.write_bytes(BODY[:-1] + b"X")
    assert not is_done(path)
    assert (cached(entry, tmp_path, progress=False, opener=good).read_bytes() == BODY
            and len(good.calls) == 2)
    record_path(path).write_text("{")                        # a torn record: not done
    assert not is_done(path)


def test_expected_size_and_hash_are_checked(tmp_path):
    with pytest.raises(FetchError, match="expected 5"):
        cached(CachedFile("a", URL, size=5), tmp_path, progress=False, opener=opener())
    with pytest.raises(FetchError, match="SHA-256"):
        cached(CachedFile("b", URL, sha256="0" * 64), tmp_path, progress=False, opener=opener())
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_fetch_hellaswag_goes_to_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPT2NP_CACHE", str(tmp_path / "env"))
    monkeypatch.setattr(urllib.request, "urlopen", opener())
    assert fetch_cli.main(["hellaswag", "--timeout", "1"]) == 0
    assert (tmp_path / "env" / "hellaswag_val.jsonl").read_bytes() == BODY
    assert fetch_cli.main(["hellaswag", "--dir", str(tmp_path / "flag")]) == 0
    assert is_done(tmp_path / "flag" / "hellaswag_val.jsonl")
    assert fetch_cli.main(["hellaswag", "--dir", str(tmp_path / "flag")]) == 0
    assert "already present" in capsys.readouterr().err
    monkeypatch.setattr(urllib.request, "urlopen", opener(reset_after=100))
    assert fetch_cli.main(["hellaswag", "--dir", str(tmp_path / "other")]) == 1
    assert "Connection reset" in capsys.readouterr().err


def test_mark_done_makes_a_local_copy_count(tmp_path):
    (tmp_path / "x").write_bytes(BODY)
    record = mark_done(tmp_path / "x")
    assert (record == {"size": len(BODY), "sha256": hashlib.sha256(BODY).hexdigest()}
            and is_done(tmp_path / "x"))


def test_a_file_in_the_way_of_the_cache_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("x")
    entry = CachedFile("f.jsonl", URL)
    with pytest.raises(BadInput) as e:
        cached(entry, tmp_path / "a.txt", opener=opener())
    assert str(e.value).startswith("--dir ") and "a.txt: is a file" in str(e.value)
    with pytest.raises(BadInput) as e:
        cached(entry, tmp_path / "a.txt" / "sub", opener=opener())
    assert "a.txt is a file" in str(e.value)
    monkeypatch.setenv("GPT2NP_CACHE", str(tmp_path / "a.txt"))
    with pytest.raises(BadInput) as e:
        cached(entry, opener=opener())
    assert str(e.value).startswith("$GPT2NP_CACHE ")
