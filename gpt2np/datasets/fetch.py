"""Downloading the files gpt2np can use: tinyshakespeare, llm.c's starter pack, GPT-2's BPE files
(the command: gpt2np.cli.fetch).

download() never hangs: every connect and read has a socket timeout; any failure (offline, timeout,
HTTP error, short read) raises FetchError with one line. Files are written to a temporary file
next to the destination and renamed into place only when complete.
"""
import http.client
import socket
import urllib.error
import urllib.request
from pathlib import Path

from gpt2np.fileio import atomic_write
from gpt2np.progress import progress as show_progress

TINYSHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                       "tinyshakespeare/input.txt")
STARTER_PACK_URL = "https://huggingface.co/datasets/karpathy/llmc-starter-pack/resolve/main/"
GPT2_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"

# local file name -> URL
KNOWN_FILES = {
    "tinyshakespeare.txt": TINYSHAKESPEARE_URL,
    "gpt2_124M.bin": STARTER_PACK_URL + "gpt2_124M.bin",
    "gpt2_124M_bf16.bin": STARTER_PACK_URL + "gpt2_124M_bf16.bin",
    "gpt2_tokenizer.bin": STARTER_PACK_URL + "gpt2_tokenizer.bin",
    "gpt2_124M_debug_state.bin": STARTER_PACK_URL + "gpt2_124M_debug_state.bin",
    "gpt2_vocab.bpe": GPT2_BPE_URL + "vocab.bpe",
    "gpt2_encoder.json": GPT2_BPE_URL + "encoder.json",
}
CHUNK_BYTES = 1 << 16


class FetchError(OSError):
    """A download failed; the message is one line naming the URL and the reason."""

    def __str__(self):
        return self.args[0] if self.args else ""


def download(url, dest, timeout=10, progress=True, opener=None):
    """Download `url` to the file `dest` (atomically), with a progress bar on stderr.

    timeout: seconds allowed for the connection and for each read. opener(request, timeout=) ->
    response replaces urllib.request.urlopen (tests). Returns dest as a Path.
    """
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        # a local folder problem, not a failed download
        raise FetchError(f"{dest.parent}: cannot make the folder for {dest.name} "
                         f"({e.strerror or e})") from None
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "gpt2np"})
        with (opener or urllib.request.urlopen)(request, timeout=timeout) as response, atomic_write(
                dest) as out:
            length = response.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            done = 0
            # a bar redrawn in place on a terminal; in logs a line every 10 s and the last one
            with show_progress(total=total, desc=dest.name, unit="B", unit_scale=True,
                               quiet=not progress) as bar:
                while True:
                    chunk = response.read(CHUNK_BYTES)
                    if not chunk:
                        break
                    out.write(chunk)
                    done += len(chunk)
                    bar.update(len(chunk))
            if total is not None and done != total:
                raise FetchError(f"could not download {url}: connection closed after {done} "
                                 f"of {total} bytes")
    except FetchError:
        raise
    except urllib.error.HTTPError as e:
        raise FetchError(f"could not download {url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise FetchError(f"could not download {url}: no answer within {timeout} s") from None
        raise FetchError(f"could not download {url}: {reason} (offline?)") from None
    except TimeoutError:
        raise FetchError(f"could not download {url}: no answer within {timeout} s") from None
    except (http.client.HTTPException, OSError, ValueError) as e:
        raise FetchError(f"could not download {url}: {type(e).__name__}: {e}") from None
    return dest


def ensure(filename, dest_dir="checkpoints", timeout=10, progress=True):
    """Path of dest_dir/filename, downloading it from KNOWN_FILES first if it is missing."""
    path = Path(dest_dir) / filename
    if path.is_file():
        return path
    if filename not in KNOWN_FILES:
        raise FetchError(f"{path}: missing, and no known URL for {filename}")
    return download(KNOWN_FILES[filename], path, timeout=timeout, progress=progress)
