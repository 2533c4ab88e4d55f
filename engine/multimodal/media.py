"""Where a prompt's media (an image, an audio clip) is read from, shared by `image` and
`audio`: a local path, a `file://` URI or a base64 `data:` URI, read to bytes with a cap on a
file's size, and refused, with a message naming the location and the fix, when it cannot be:
the engine reads nothing from the network, and a device or a pipe (whose reading may never
end) or a file over the cap is refused unread."""

import base64
import binascii
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass(frozen=True)
class MediaKind:
    """A kind of media as the messages of a failed read name it: the error raised (the
    module's own `ValueError`), the noun ("image"), an example `data:` URI, what a file over
    the size cap is larger than, and how to shrink it."""

    error: type[ValueError]
    noun: str
    data_uri: str
    cap: str
    shrink: str


def read_location(location: str, max_bytes: int, kind: MediaKind) -> bytes:
    """The bytes of a local path, a `file://` or a base64 `data:` URI (a file of at most
    `max_bytes`).

    Raises:
        kind.error: a `data:` URI that is not base64 or does not decode, a URL of another
            scheme (http, s3: the engine reads nothing from the network), a path that does not
            exist, is not a regular file or is larger than `max_bytes`.
    """
    if location.startswith("data:"):
        header, _, payload = location.partition(",")
        if not header.endswith(";base64"):
            raise kind.error(f"a data: URI must be base64-encoded ({kind.data_uri})")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise kind.error(f"the data: URI's base64 payload does not decode ({exc}): fix the encoding") from exc
    try:
        url = urlparse(location)
    except ValueError as exc:  # "file://[x": a bracket that opens no IPv6 address
        raise kind.error(f"{short_location(location)}: is not a usable path or URI ({exc}): fix it") from exc
    if url.scheme and url.scheme != "file" and len(url.scheme) > 1:  # "C:" is a Windows drive, not a scheme
        raise kind.error(f"{short_location(location)}: the engine does not fetch {url.scheme}:// URLs (it reads "
                         f"nothing from the network): download the {kind.noun} and pass its bytes or a local path")
    return _read_file(unquote(url.path) if url.scheme == "file" else location, max_bytes, kind)


def _read_file(location: str, max_bytes: int, kind: MediaKind) -> bytes:
    """The bytes of a local file; a device or a pipe and a file of more than `max_bytes` are
    refused unread."""
    try:
        path = Path(location).expanduser()
        info = path.stat()
        regular, size = stat.S_ISREG(info.st_mode), info.st_size
        data = path.read_bytes() if regular and size <= max_bytes else b""
    except OSError as exc:
        raise kind.error(f"{short_location(location)}: cannot be read ({exc.strerror or exc}): fix the path") from exc
    except (ValueError, RuntimeError) as exc:  # a NUL in the path; "~user" of no such user
        raise kind.error(f"{short_location(location)}: is not a usable path ({exc}): fix the path") from exc
    if not regular:
        raise kind.error(f"{short_location(location)}: is not a file (a directory, device or pipe): give the path of "
                         f"an {kind.noun} file")
    if size > max_bytes:
        raise kind.error(f"{short_location(location)}: is {size:,} bytes, more than {kind.cap} ({max_bytes:,}): "
                         f"{kind.shrink}")
    return data


def short_location(location: str) -> str:
    """A location as a one-line message shows it: quoted where it holds a newline or another
    unprintable character, its middle cut where it is long."""
    shown = location if location.isprintable() else repr(location)
    return shown if len(shown) <= 80 else shown[:60] + "..." + shown[-12:]
