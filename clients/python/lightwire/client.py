"""HTTP client for the lightwire sidecar's control API (docs/api.md).

Standard library only: ``http.client`` over the control Unix socket (default) or TCP. One
persistent keep-alive connection per thread; a request that fails on a reused connection
because the sidecar closed it (idle timeout, restart) is retried once on a new connection.
"""

import http.client
import json
import os
import socket
import threading
import time
from urllib.parse import quote, urlsplit

from ._errors import LightwireError, SidecarUnavailable
from ._tensor import DTYPE_SIZES, to_wire

DEFAULT_SOCKET = "/run/lightwire/lightwire.sock"
DEFAULT_CONNECT_TIMEOUT = 5.0
# Longer than the sidecar's default limits.step_timeout_s (120 s): a step that waits for a slow
# local trainer must end with the sidecar's 504 (which every trainer gets together), not with
# one trainer's local timeout.
DEFAULT_READ_TIMEOUT = 150.0

_RETRYABLE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError,
              http.client.RemoteDisconnected, http.client.CannotSendRequest)


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTPConnection over an AF_UNIX stream socket."""

    def __init__(self, path, timeout, connect_timeout):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path
        self.connect_timeout = connect_timeout

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.connect_timeout)
            sock.connect(self.unix_path)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _TCPHTTPConnection(http.client.HTTPConnection):
    """HTTPConnection with a connect timeout distinct from the read timeout."""

    def __init__(self, host, port, timeout, connect_timeout):
        super().__init__(host, port, timeout=timeout)
        self.connect_timeout = connect_timeout

    def connect(self):
        sock = socket.create_connection((self.host, self.port), self.connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _q(value):
    # Tensor names use [A-Za-z0-9_.:/-]; keep ":", "/" and "," literal (legal in a query).
    return quote(str(value), safe="._-:/,")


def _error_from(status, body):
    try:
        doc = json.loads(body.decode("utf-8"))
        if isinstance(doc, dict) and "error" in doc:
            return LightwireError(status, str(doc.get("error")), str(doc.get("message", "")))
    except (ValueError, UnicodeDecodeError):
        pass
    text = body.decode("utf-8", "replace").strip()
    return LightwireError(status, "http_%d" % status, text or http.client.responses.get(status, ""))


def _retry_after(resp, error):
    """Seconds to wait before sending a refused request again, or None: only for the refusals
    the sidecar makes before it reads a request (docs/RELIABILITY.md "Overload"), 503 `busy` and
    429 `limit_reached`, with a Retry-After of at most 5 seconds."""
    if (error.status, error.error) not in ((503, "busy"), (429, "limit_reached")):
        return None
    try:
        wait = float(resp.getheader("Retry-After"))
    except (TypeError, ValueError):
        return None
    return min(max(wait, 0.05), 5.0)


def _read_refusal(conn):
    """(error, seconds to wait or None) from a reply already sent on a connection whose request
    could not be sent (the sidecar refused the connection and closed it), or None."""
    sock = getattr(conn, "sock", None)
    if sock is None:
        return None
    try:
        sock.settimeout(0.5)
        resp = http.client.HTTPResponse(sock, method="GET")
        resp.begin()
        body = resp.read()
    except (OSError, http.client.HTTPException, ValueError):
        return None
    if resp.status < 400:
        return None
    error = _error_from(resp.status, body)
    return error, _retry_after(resp, error)


class Response(object):
    """A complete reply: ``status``, ``headers`` (an http.client.HTTPMessage), ``body``."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body.decode("utf-8")) if self.body else {}


class LayoutHashes(object):
    """The layout hash a sidecar holds for each bucket name, so that a trainer sends a bucket's
    layout once (docs/api.md "Layouts: one tensor per layer"), by either form of
    ``emit_gradient``. Thread-safe."""

    def __init__(self):
        self._hashes = {}
        self._lock = threading.Lock()
        self.by_hash = True  # False: the sidecar predates layout_hash (the layout every time)

    def send(self, bucket, layout, emit):
        """One step of ``bucket``: ``emit(layout, layout_hash)`` sends the request and returns
        ``(result, the reply's layout hash)``. It gets the layout the first time, then the hash
        only, and the layout again when the sidecar holds none (404 ``unknown_layout``: it
        restarted). Returns the result."""
        with self._lock:
            known = self._hashes.get(bucket)
        try:
            result, got = emit(None if known else layout, known)
        except LightwireError as e:
            unknown = e.status == 404 and e.error == "unknown_layout"
            # A sidecar older than layout_hash refuses it as an unknown field or parameter.
            older = e.status == 400 and "'layout_hash' (known:" in (e.message or "")
            if known is None or not (unknown or older):
                raise
            with self._lock:
                if older:
                    self.by_hash = False
                self._hashes.pop(bucket, None)
            result, got = emit(layout, None)
        if got and self.by_hash:
            with self._lock:
                self._hashes[bucket] = str(got)
        return result


class Client(object):
    """A client of one sidecar.

    ``socket_path``: the control Unix socket (else env ``LIGHTWIRE_SOCKET``, else
    ``/run/lightwire/lightwire.sock``). ``url``: ``http://HOST:PORT`` to use TCP instead.
    ``timeout``: seconds, one number (read timeout; connect timeout min(it, 5 s)) or a
    ``(connect, read)`` pair. ``trainer``: this trainer's local index, sent when not None.
    ``token``: bearer token (env ``LIGHTWIRE_TOKEN``), needed on TCP when the sidecar sets one.
    """

    def __init__(self, socket_path=None, url=None, timeout=None, trainer=None, token=None):
        if timeout is None:
            timeout = (DEFAULT_CONNECT_TIMEOUT, DEFAULT_READ_TIMEOUT)
        if isinstance(timeout, (tuple, list)):
            self.connect_timeout, self.read_timeout = float(timeout[0]), float(timeout[1])
        else:
            self.read_timeout = float(timeout)
            self.connect_timeout = min(self.read_timeout, DEFAULT_CONNECT_TIMEOUT)
        self.trainer = trainer
        self.token = token if token is not None else os.environ.get("LIGHTWIRE_TOKEN") or None
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError("lightwire: url must look like http://HOST:PORT, got %r" % url)
            self.url = url
            self.socket_path = None
            self._host, self._port = parts.hostname, parts.port or 80
        else:
            self.url = None
            self.socket_path = socket_path or os.environ.get("LIGHTWIRE_SOCKET") or DEFAULT_SOCKET
        self._local = threading.local()
        self._all_conns = []
        self._conns_lock = threading.Lock()
        self._layouts_sent = LayoutHashes()  # emit_layers' buckets
        self.last_figures = None

    def __repr__(self):
        where = self.url if self.url else "unix:" + self.socket_path
        return "lightwire.Client(%s)" % where

    # ------------------------------------------------------------------ transport

    def _new_conn(self):
        if self.url is not None:
            conn = _TCPHTTPConnection(self._host, self._port, self.read_timeout, self.connect_timeout)
        else:
            conn = _UnixHTTPConnection(self.socket_path, self.read_timeout, self.connect_timeout)
        with self._conns_lock:
            self._all_conns.append(conn)
        return conn

    def close(self):
        """Close every connection this client opened (in any thread)."""
        with self._conns_lock:
            conns, self._all_conns = self._all_conns, []
        for c in conns:
            try:
                c.close()
            except Exception:
                pass
        self._local = threading.local()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _drop_conn(self):
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        self._local.used = False
        if conn is not None:
            conn.close()
            with self._conns_lock:
                try:
                    self._all_conns.remove(conn)
                except ValueError:
                    pass

    def request(self, method, path, body=None, headers=None, read_into=None):
        """Send one request and read the whole reply. Returns a Response (status < 400);
        raises LightwireError from an error body, SidecarUnavailable on connection problems.

        ``read_into``: callable(status, headers, length) -> writable byte memoryview or None;
        for a 200 reply whose length it accepts, the body is read into that view (no copy)."""
        hdrs = {"Host": "localhost"} if self.url is None else {}
        if self.token:
            hdrs["Authorization"] = "Bearer " + self.token
        if headers:
            hdrs.update(headers)
        if body is not None and "Content-Length" not in hdrs:
            hdrs["Content-Length"] = str(memoryview(body).nbytes if not isinstance(body, str) else len(body.encode()))
        deadline = time.monotonic() + self.connect_timeout
        attempt = 0
        while True:
            attempt += 1
            conn = getattr(self._local, "conn", None)
            reused = conn is not None and getattr(self._local, "used", False)
            if conn is None:
                conn = self._local.conn = self._new_conn()
                self._local.used = False
            try:
                conn.request(method, path, body=body, headers=hdrs)
                resp = conn.getresponse()
                status = resp.status
                length = resp.getheader("Content-Length")
                length = int(length) if length is not None else None
                target = None
                if read_into is not None and status == 200 and length is not None:
                    target = read_into(status, resp.msg, length)
                if target is not None:
                    got = 0
                    while got < length:
                        n = resp.readinto(target[got:])
                        if not n:
                            raise http.client.IncompleteRead(b"", length - got)
                        got += n
                    data = target
                    resp.read()  # lets http.client finish the message
                else:
                    data = resp.read()
                if resp.will_close:
                    self._drop_conn()
                else:
                    self._local.used = True
            except _RETRYABLE as e:
                refusal = None if reused else _read_refusal(conn)
                self._drop_conn()
                if attempt == 1 and reused:
                    continue  # the sidecar closed a kept-alive connection: once more, afresh
                if refusal is not None:
                    # A new connection the sidecar refused before reading the request (503 busy):
                    # its reply may still be there to read, though the send failed.
                    error, wait = refusal
                    if wait is not None and time.monotonic() + wait < deadline:
                        time.sleep(wait)
                        continue
                    raise error from e
                raise SidecarUnavailable("%s %s via %s: %s" % (method, path, self._where(), _describe(e))) from e
            except (socket.timeout, TimeoutError) as e:
                self._drop_conn()
                raise SidecarUnavailable("%s %s via %s: timed out" % (method, path, self._where()),
                                         error="timeout") from e
            except (OSError, http.client.HTTPException) as e:
                self._drop_conn()
                raise SidecarUnavailable("%s %s via %s: %s" % (method, path, self._where(), _describe(e))) from e
            except BaseException:
                self._drop_conn()  # e.g. KeyboardInterrupt mid-reply: the connection is unusable
                raise
            if status >= 400:
                error = _error_from(status, bytes(data))
                wait = _retry_after(resp, error)
                if wait is not None and time.monotonic() + wait < deadline:
                    # Refused before the sidecar read the request (a listener's connections all
                    # in use, or request bodies held at once at their cap): nothing happened, so
                    # the same request again once the sidecar says, within the connect timeout.
                    time.sleep(wait)
                    continue
                raise error
            return Response(status, resp.msg, data)

    def _where(self):
        return self.url if self.url else self.socket_path

    def _json(self, method, path, doc):
        body = json.dumps(doc).encode("utf-8")
        return self.request(method, path, body=body, headers={"Content-Type": "application/json"})

    def _trainer(self, trainer):
        return self.trainer if trainer is None else trainer

    # ------------------------------------------------------------------ API

    def emit_gradient(self, tensor, name, step, trainer=None, layout=None, layout_hash=None):
        """Form 1 (raw body): send ``tensor`` (numpy float32/float16 array, or CPU torch
        float32/float16/bfloat16 tensor) as this trainer's part of ``step`` of tensor ``name``;
        returns the averaged tensor, of the same type, dtype and shape (a new object).
        ``last_figures`` holds the step's figures from the reply's headers.

        ``layout`` (optional): ``tensor`` is a bucket of parameters, a list of
        ``{"name", "offset", "shape"}`` (offsets in elements from the tensor's start), each
        exchanged as a tensor of its own (docs/api.md "Layouts: one tensor per layer"); ``name``
        then names the bucket. The layout goes ahead of the tensor's bytes in the body.
        ``layout_hash`` (optional): instead of ``layout``, the ``last_figures["layout_hash"]`` of an
        earlier step of this bucket name. A trainer sends the layout once, then only the hash, and
        the layout again when the sidecar answers 404 ``unknown_layout`` (it restarted and holds
        none): ``emit_layers`` does exactly that."""
        out, self.last_figures = self._emit_raw(tensor, name, step, trainer, layout, layout_hash)
        return out

    def emit_layers(self, tensor, name, step, layout, trainer=None):
        """``emit_gradient`` of a bucket whose layout is sent once: with ``layout`` the first
        time, then with the layout hash the sidecar replied, and with ``layout`` again when the
        sidecar holds no layout under ``name`` (it restarted: 404 ``unknown_layout``). Returns
        the averaged tensor; ``last_figures`` as ``emit_gradient``."""
        def emit(layout, layout_hash):
            out, figures = self._emit_raw(tensor, name, step, trainer, layout, layout_hash)
            self.last_figures = figures
            return out, figures["layout_hash"]

        return self._layouts_sent.send(name, layout, emit)

    def _emit_raw(self, tensor, name, step, trainer, layout, layout_hash):
        """Form 1 of ``tensor``; returns (the averaged tensor, the figures of the reply)."""
        wire = to_wire(tensor)
        params = [("name", name), ("step", int(step)), ("dtype", wire.dtype)]
        shape = wire.shape_param()
        if shape is not None:
            params.append(("shape", shape))
        trainer = self._trainer(trainer)
        if trainer is not None:
            params.append(("trainer", int(trainer)))
        headers = {"Content-Type": "application/octet-stream"}
        body = wire.body
        if layout is not None:
            # The layout's JSON, padded with spaces to a multiple of 8 bytes so that the values
            # after it stay aligned in the sidecar's copy of the body (no move there).
            prefix = json.dumps(layout, separators=(",", ":")).encode("utf-8")
            prefix += b" " * (-len(prefix) % 8)
            params.append(("layout_bytes", len(prefix)))
            body = [prefix, wire.body]  # sent one after the other: the tensor is not copied
            headers["Content-Length"] = str(len(prefix) + wire.nbytes)
        if layout_hash is not None:
            params.append(("layout_hash", str(layout_hash)))
        path = "/v1/emit_gradient?" + "&".join("%s=%s" % (k, _q(v)) for k, v in params)
        out = {}

        def read_into(status, headers, length):
            if length != wire.nbytes:
                return None
            obj, view = wire.empty_like()
            out["obj"] = obj
            return view

        resp = self.request("POST", path, body=body, headers=headers, read_into=read_into)
        if "obj" not in out:
            raise LightwireError(resp.status, "bad_reply",
                                 "emit_gradient reply has %d bytes, expected %d" % (len(resp.body), wire.nbytes))
        figures = {
            "codec": resp.headers.get("X-Lightwire-Codec"),
            "raw_bytes": _int_or_none(resp.headers.get("X-Lightwire-Raw-Bytes")),
            "wire_bytes": _int_or_none(resp.headers.get("X-Lightwire-Wire-Bytes")),
            "nonfinite": resp.headers.get("X-Lightwire-Nonfinite") == "1",
            # None when the sidecar does not send them (Form 2's JSON reply always has them).
            "mode": resp.headers.get("X-Lightwire-Mode"),
            "settings": _int_or_none(resp.headers.get("X-Lightwire-Settings")),
            # None unless the request carried a layout or its hash.
            "layout_hash": resp.headers.get("X-Lightwire-Layout-Hash"),
        }
        return out["obj"], figures

    def register_buffer(self, shm, size=None):
        """Register a shared-memory segment (a ``ShmSegment``, or an ``shm_open`` name with its
        ``size``); returns the buffer id. A ``ShmSegment`` gets its ``buffer_id`` set."""
        name = getattr(shm, "shm_name", None)
        if name is None:
            name = str(shm)
            if not name.startswith("/"):
                name = "/" + name
        if size is None:
            size = getattr(shm, "size", None)
            if size is None:
                raise ValueError("lightwire: register_buffer needs the segment's size")
        doc = self._json("POST", "/v1/buffers", {"kind": "shm", "name": name, "size": int(size)}).json()
        bid = str(doc["id"])
        if hasattr(shm, "buffer_id"):
            shm.buffer_id = bid
        return bid

    def register_cuda(self, tensor, event=None, name=None):
        """Register a CUDA tensor's memory through CUDA IPC (``POST /v1/buffers`` with kind
        ``cuda_ipc``); returns the buffer id. The tensor must stay alive (and must not move)
        while registered. ``event``: a ``torch.cuda.Event(interprocess=True)`` the trainer
        records after writing each gradient; the sidecar orders its reads after it. Without one,
        synchronise the producing stream before each emit. The sidecar writes each result in
        place before it replies. Raises ``LightwireError`` 409 ``failed_precondition`` when the
        sidecar has no CUDA driver (use the shared-memory path instead)."""
        doc = cuda_ipc_spec(tensor, event=event, name=name)
        return str(self._json("POST", "/v1/buffers", doc).json()["id"])

    def release_buffer(self, buffer_id):
        """``DELETE /v1/buffers/{id}`` (accepts a registered ``ShmSegment`` too)."""
        seg = None
        if hasattr(buffer_id, "buffer_id"):
            seg, buffer_id = buffer_id, buffer_id.buffer_id
        self.request("DELETE", "/v1/buffers/" + _q(buffer_id))
        if seg is not None:
            seg.buffer_id = None

    def emit_gradient_shm(self, buffer, name, step, dtype="float32", shape=None, offset=0, trainer=None,
                          layout=None, layout_hash=None, timing=None, order=None, momentum=None):
        """Form 2: the tensor lies in registered buffer ``buffer`` (an id or a registered
        ``ShmSegment``) at ``offset``; the averaged result is written there in place. Returns
        the reply's JSON (the step's figures). ``shape`` defaults to the whole buffer, 1-D.

        ``layout`` (optional): the bucket's parameters, a list of ``{"name", "offset", "shape"}``
        (offsets in elements from ``offset``), each exchanged as a tensor of its own
        (docs/api.md "Layouts: one tensor per layer"); the reply then lists them in ``layers``.
        ``layout_hash`` (optional): instead of ``layout``, the reply's ``layout_hash`` of an earlier
        step of this bucket name, so that the layout is sent once; a sidecar that does not hold it
        (it restarted) answers 404 ``unknown_layout``: send ``layout`` again.
        ``timing`` (optional): ``(compute_s, overlap_s[, direct_s[, tail_s]])``, the trainer's
        compute per iteration that falls to this tensor, the part of it the tensor's exchange can
        hide behind, and what the trainers' own process group (in direct windows) and the sidecars
        (otherwise) added beyond the compute (None: not measured), for ``codec: auto``
        (docs/policies.md "codec: auto").
        ``order`` (optional): ``(stream, iteration, position)``, the step's place in the trainer's
        numbering, so that the sidecars run steps sent together in that order whatever order they
        arrive in (docs/api.md "Buckets in flight").
        ``momentum`` (optional): the momentum the trainer's optimizer takes back from the sidecar
        where a rung of ``codec: auto`` applies dgc's momentum correction (``lightwire.torch.SGD``
        and ``AdamW`` can; docs/policies.md "codec: auto"); without it no such rung is taken."""
        if hasattr(buffer, "buffer_id"):
            if buffer.buffer_id is None:
                raise ValueError("lightwire: %r is not registered" % (buffer,))
            if shape is None:
                shape = [(buffer.size - int(offset)) // DTYPE_SIZES[dtype]]
            buffer = buffer.buffer_id
        if shape is None:
            raise ValueError("lightwire: emit_gradient_shm needs a shape")
        if isinstance(shape, int):
            shape = [shape]
        doc = {"name": name, "step": int(step), "buffer": str(buffer), "offset": int(offset),
               "dtype": dtype, "shape": [int(d) for d in shape]}
        trainer = self._trainer(trainer)
        if trainer is not None:
            doc["trainer"] = int(trainer)
        if layout is not None:
            doc["layout"] = layout
        if layout_hash is not None:
            doc["layout_hash"] = str(layout_hash)
        if timing is not None:
            doc["compute_s"], doc["overlap_s"] = float(timing[0]), float(timing[1])
            for key, value in zip(("direct_s", "tail_s"), timing[2:]):
                if value is not None:
                    doc[key] = float(value)
        if order is not None:
            doc["order"] = _order_doc(order)
        if momentum is not None:
            doc["momentum"] = float(momentum)
        return self._json("POST", "/v1/emit_gradient", doc).json()

    def cancel(self, order, name=None, step=None):
        """``POST /v1/cancel``: the place ``order`` (``(stream, iteration, position)``) will not be
        sent, so the steps after it need not wait for it; ``name`` and ``step`` (together) name the
        step to the other sidecars. Returns whether anything was cancelled (False: the place has
        run or was cancelled already). docs/api.md "Buckets in flight"."""
        doc = {"order": _order_doc(order)}
        if name is not None:
            doc["name"], doc["step"] = str(name), int(step)
        return bool(self._json("POST", "/v1/cancel", doc).json().get("cancelled"))

    def report(self, step, loss=None, fallbacks=None, trainer=None, reward=None):
        """``POST /v1/report``: the trainer's loss, reward and/or fallback count for ``step``. The
        loss and the reward (higher is better: a reinforcement-learning trainer's return) travel
        with the sidecar's next exchanged step to every sidecar, where the mean over the ranks that
        reported feeds the rollback policy (docs/api.md, docs/policies.md "Settings versions and
        rollback"); report them after step ``step`` and before the next step's gradients. Both
        must be finite (the sidecar answers 400 otherwise)."""
        doc = {"step": int(step)}
        trainer = self._trainer(trainer)
        if trainer is not None:
            doc["trainer"] = int(trainer)
        if loss is not None:
            doc["loss"] = float(loss)
        if reward is not None:
            doc["reward"] = float(reward)
        if fallbacks is not None:
            doc["fallbacks"] = int(fallbacks)
        return self._json("POST", "/v1/report", doc).json()

    def put_config(self, compression):
        """``PUT /v1/config`` with the ``compression`` settings (a dict, the keys of the YAML
        file's ``compression`` section). Returns the parsed reply: with the policies (every
        sidecar of this version) ``202 {"applied": false, "proposal": id, ...}`` -- the settings
        travel with this sidecar's next exchanged step to every sidecar and take effect, on all of
        them, at the step after it (``settings`` in the step replies says which version a step
        ran with); a sidecar without them answers ``200 {"applied": true}``. Raises
        ``LightwireError`` (400 for invalid settings, 401 without the token)."""
        return self._json("PUT", "/v1/config", compression).json()

    def checkpoint(self, step):
        """``POST /v1/checkpoint {"step": step}``: this sidecar saves its codec and policy state
        as it stands after ``step`` now, and every other sidecar of the job saves its own when the
        request reaches it with the next exchanged step. Call it after step ``step`` completed and
        before sending any gradient of the next step (otherwise ``409``). Returns the reply
        ``{"step", "path", "peers"}`` (``path``: the file this sidecar wrote)."""
        return self._json("POST", "/v1/checkpoint", {"step": int(step)}).json()

    def resume(self, step):
        """``POST /v1/resume {"step": step}``: this sidecar restores its own checkpoint of
        ``step`` (codec and policy state); the next step of every tensor is ``step + 1``. Every
        sidecar of the job must be told (each trainer calls it on its own sidecar): they compare
        at the next step and fail it everywhere (``409 resume_mismatch``) when they disagree.
        Raises ``LightwireError`` 404 when there is no such checkpoint, 409 when it cannot be
        used (corrupted, another job, rank or world size). Returns the reply."""
        return self._json("POST", "/v1/resume", {"step": int(step)}).json()

    def status(self):
        """``GET /v1/status`` as a dict."""
        return self.request("GET", "/v1/status").json()

    def metrics(self):
        """``GET /metrics`` as text."""
        return bytes(self.request("GET", "/metrics").body).decode("utf-8")

    def healthz(self):
        """True when ``GET /healthz`` answers 200; False when it does not or cannot be reached."""
        try:
            return self.request("GET", "/healthz").status == 200
        except LightwireError:
            return False

    def wait_ready(self, timeout=300.0, interval=0.25, progress=None):
        """Wait until ``GET /readyz`` answers 200 (every listener up, every peer connected).

        For trainers started next to their sidecar (a container or pod starts both at once):
        the sidecar may not exist yet, or wait for its peers. ``progress``: called with a
        one-line reason about every 10 s while waiting. Raises ``SidecarUnavailable`` (error
        ``"not_ready"``) with the last reason after ``timeout`` seconds."""
        import time
        deadline = time.monotonic() + float(timeout)
        next_note = time.monotonic() + 10.0
        while True:
            try:
                r = self.request("GET", "/readyz")
                if r.status == 200:
                    return
                why = "readyz %d: %s" % (r.status, bytes(r.body).decode("utf-8", "replace").strip())
            except LightwireError as e:
                why = str(e)
            now = time.monotonic()
            if now >= deadline:
                raise SidecarUnavailable("%r not ready after %.0f s (%s)" % (self, timeout, why),
                                         error="not_ready")
            if progress is not None and now >= next_note:
                progress("waiting for %r: %s" % (self, why))
                next_note = now + 10.0
            time.sleep(min(interval, max(deadline - now, 0.0)))


def pci_bus_id(device):
    """The PCI bus id ("0000:3b:00.0") of a CUDA device (a torch.device or index), as the CUDA
    driver names it: how the sidecar finds the GPU whatever CUDA_VISIBLE_DEVICES each process
    has."""
    import subprocess
    import torch
    props = torch.cuda.get_device_properties(device)
    try:
        return "%04x:%02x:%02x.0" % (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except AttributeError:
        pass
    # Older PyTorch: match the device's UUID in nvidia-smi's table.
    uuid = str(getattr(props, "uuid", "") or "").lower().replace("gpu-", "")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and uuid and parts[0].lower().replace("gpu-", "") == uuid:
            return parts[1]
    raise ValueError("lightwire: cannot tell the PCI bus id of %s (this PyTorch %s does not "
                     "report it and nvidia-smi did not help); CUDA IPC registration needs it"
                     % (device, torch.__version__))


def cuda_ipc_spec(tensor, event=None, name=None):
    """The ``POST /v1/buffers`` document that registers ``tensor`` (contiguous, on a GPU) through
    CUDA IPC, from PyTorch's own IPC export (``UntypedStorage._share_cuda_``): the handle names
    the allocator block that holds the storage, so the registered range is the storage's offset
    in that block plus the tensor's offset in the storage."""
    if not tensor.is_cuda:
        raise ValueError("lightwire: register_cuda takes a CUDA tensor, got one on %s" % tensor.device)
    if not tensor.is_contiguous():
        raise ValueError("lightwire: register_cuda takes a contiguous tensor")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    handle, storage_offset = shared[1], shared[3]
    if not isinstance(handle, (bytes, bytearray)) or len(handle) != 64:
        raise ValueError("lightwire: unexpected CUDA IPC handle from this PyTorch: %r" % (handle,))
    esize = tensor.element_size()
    doc = {"kind": "cuda_ipc", "handle": bytes(handle).hex(), "device": pci_bus_id(tensor.device),
           "offset": int(storage_offset) + tensor.storage_offset() * esize,
           "size": tensor.numel() * esize}
    if event is not None:
        doc["event"] = bytes(event.ipc_handle()).hex()
    if name is not None:
        doc["name"] = str(name)
    return doc


def _order_doc(order):
    stream, iteration, position = order
    return {"stream": str(stream), "iteration": int(iteration), "position": int(position)}


def _int_or_none(v):
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _describe(e):
    s = str(e)
    return "%s: %s" % (type(e).__name__, s) if s else type(e).__name__


_default = None
_default_lock = threading.Lock()


def default_client():
    """The module-level client, created on first use from ``LIGHTWIRE_SOCKET``."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Client()
        return _default


def emit_gradient(tensor, name, step, trainer=None, layout=None, layout_hash=None):
    """``default_client().emit_gradient(...)``."""
    return default_client().emit_gradient(tensor, name=name, step=step, trainer=trainer,
                                          layout=layout, layout_hash=layout_hash)


def emit_layers(tensor, name, step, layout, trainer=None):
    """``default_client().emit_layers(...)``."""
    return default_client().emit_layers(tensor, name=name, step=step, layout=layout,
                                        trainer=trainer)


def report(step, loss=None, fallbacks=None, trainer=None, reward=None):
    """``default_client().report(...)``."""
    return default_client().report(step, loss=loss, fallbacks=fallbacks, trainer=trainer,
                                   reward=reward)


def checkpoint(step):
    """``default_client().checkpoint(step)``."""
    return default_client().checkpoint(step)


def resume(step):
    """``default_client().resume(step)``."""
    return default_client().resume(step)
