"""A TCP relay for fault-injection tests: listens on 127.0.0.1 (an OS-chosen port), forwards every
connection it accepts to a target address, and can be told, from any thread, to break the traffic.

    relay = FaultRelay(target_port).start()    # relay.port: point the connecting side here
    relay.reset_after("c2s", 1 << 20)          # RST both sides after 1 MiB more client->target
    relay.flip_payload("s2c", 1000)            # flip byte 1000 of the next DATA frame's payload
    relay.flip_at("c2s", 5)                    # flip the 6th byte from now, whatever it is
    relay.stall(); relay.pass_through()        # stop forwarding / forward again (clears faults)
    relay.wait_fired(5.0)                      # True once the armed fault has happened
    relay.close()

Directions: "c2s" is what the accepted (connecting) side sends to the target, "s2c" the reverse.
Each fault fires once, on whichever connection carries its direction next, then the relay passes
traffic through again. A reset sets SO_LINGER 0 on both sockets and closes them, so both ends get
an RST (ECONNRESET), not an orderly FIN.

One thread runs every socket with a selector (non-blocking I/O): no thread is ever blocked in a
recv() on a socket another thread closes (on Linux such a close neither wakes the reader nor
resets the connection). `flip_payload` parses the lightwire peer frames (docs/peer-protocol.md:
64-byte header, frame type at byte 6, payload length at bytes 48..55) so the flipped byte lands
inside a payload, where only the XXH3 checksum can catch it.
"""

import errno
import selectors
import socket
import struct
import threading
import time

HEADER_BYTES = 64
DATA_FRAME = 4
DIRECTIONS = ("c2s", "s2c")
_HIGH_WATER = 1 << 20  # stop reading a side while this much is waiting to be written to the other


class _Stream(object):
    """One direction of one connection: bytes seen so far and where the frames are."""

    def __init__(self):
        self.pos = 0            # bytes of this direction seen (before this chunk)
        self.header = b""       # the frame header being collected
        self.payload_left = 0   # payload bytes of the current frame still to come
        self.flip_pos = None    # absolute position of a byte to flip (flip_payload, once found)

    def frames(self, data):
        """Feeds `data` (the original bytes); returns [(payload start position, type, length)]
        of the frame headers completed in it. Advances pos."""
        out = []
        i, n = 0, len(data)
        while i < n:
            if self.payload_left:
                take = min(self.payload_left, n - i)
                self.payload_left -= take
                i += take
                continue
            take = min(HEADER_BYTES - len(self.header), n - i)
            self.header += data[i:i + take]
            i += take
            if len(self.header) == HEADER_BYTES:
                length = struct.unpack_from("<Q", self.header, 48)[0]
                out.append((self.pos + i, self.header[6], length))
                self.payload_left = length
                self.header = b""
        self.pos += n
        return out


class _Conn(object):
    def __init__(self, client, target):
        self.socks = {"c2s": (client, target), "s2c": (target, client)}  # direction -> (src, dst)
        self.out = {client: bytearray(), target: bytearray()}           # waiting to be written
        self.eof = {"c2s": False, "s2c": False}                          # src sent FIN
        self.shut = {"c2s": False, "s2c": False}                         # FIN passed on to dst
        self.streams = {"c2s": _Stream(), "s2c": _Stream()}
        self.closed = False


class FaultRelay(object):
    def __init__(self, target_port, target_host="127.0.0.1"):
        self.target = (target_host, int(target_port))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._fired = threading.Event()
        self._faults = {"c2s": None, "s2c": None}  # direction -> dict, guarded by _lock
        self._stalled = False
        self._stop = False
        self._conns = []
        self._thread = None
        self.accepted = 0                              # connections accepted so far
        self.forwarded = {"c2s": 0, "s2c": 0}          # bytes passed on, per direction
        self.log = []                                  # what fired, in order (strings)

    # ------------------------------------------------------------------ control (any thread)

    def start(self):
        self._thread = threading.Thread(target=self._run, name="fault-relay-%d" % self.port, daemon=True)
        self._thread.start()
        return self

    def close(self, timeout=5.0):
        with self._lock:
            self._stop = True
        if self._thread is not None:
            self._thread.join(timeout)
            assert not self._thread.is_alive(), "fault relay thread did not stop"

    def pass_through(self):
        """Forward everything; drops armed faults and ends a stall."""
        with self._lock:
            self._faults = {"c2s": None, "s2c": None}
            self._stalled = False

    def stall(self):
        """Stop forwarding (and reading: the senders' windows fill up) until pass_through()."""
        with self._lock:
            self._stalled = True

    def reset_after(self, direction, nbytes):
        """After `nbytes` more bytes in `direction` have been passed on, reset both sides (RST)."""
        self._arm(direction, {"kind": "reset", "left": int(nbytes)})

    def flip_at(self, direction, nbytes, mask=0xFF):
        """XOR `mask` into the byte `nbytes` bytes from now in `direction` (0 = the next byte)."""
        self._arm(direction, {"kind": "flip", "left": int(nbytes), "mask": mask})

    def flip_payload(self, direction, offset, mask=0xFF):
        """XOR `mask` into byte `offset` of the payload of the next DATA frame in `direction` whose
        payload is longer than `offset` (its header must start after this call)."""
        self._arm(direction, {"kind": "flip_payload", "offset": int(offset), "mask": mask, "armed": False})

    def wait_fired(self, timeout):
        """True once the last armed fault has fired (within `timeout` seconds)."""
        return self._fired.wait(timeout)

    def _arm(self, direction, fault):
        assert direction in DIRECTIONS, direction
        with self._lock:
            self._fired.clear()
            self._faults[direction] = fault

    # ------------------------------------------------------------------ the relay's thread

    def _run(self):
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    stalled = self._stalled
                self._conns = [c for c in self._conns if not c.closed]
                for c in self._conns:
                    self._interest(sel, c, stalled)
                for key, mask in sel.select(timeout=0.02):
                    if key.data is None:
                        self._accept(sel)
                        continue
                    conn, sock = key.data
                    if conn.closed:
                        continue
                    if mask & selectors.EVENT_WRITE:
                        self._write(conn, sock)
                    if mask & selectors.EVENT_READ and not conn.closed:
                        self._read(conn, sock)
        finally:
            for c in self._conns:
                self._close(c, reset=False)
            sel.close()
            self._listener.close()

    def _interest(self, sel, conn, stalled):
        for direction in DIRECTIONS:
            src, dst = conn.socks[direction]
            if conn.closed:
                return
            ev = 0
            if not stalled and not conn.eof[direction] and len(conn.out[dst]) < _HIGH_WATER:
                ev |= selectors.EVENT_READ
            if not stalled and conn.out[src]:
                ev |= selectors.EVENT_WRITE
            # A socket's entry is keyed by the socket: register, modify or remove it.
            try:
                cur = sel.get_key(src)
            except KeyError:
                cur = None
            if ev == 0:
                if cur is not None:
                    sel.unregister(src)
            elif cur is None:
                sel.register(src, ev, (conn, src))
            elif cur.events != ev:
                sel.modify(src, ev, (conn, src))

    def _accept(self, sel):
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            target = socket.create_connection(self.target, timeout=2.0)
        except OSError:
            _reset(client)  # the target is down: the connecting side sees its attempt fail
            return
        for s in (client, target):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.accepted += 1
        conn = _Conn(client, target)
        conn.sel = sel
        self._conns.append(conn)

    def _direction_from(self, conn, sock):
        return "c2s" if conn.socks["c2s"][0] is sock else "s2c"

    def _read(self, conn, src):
        direction = self._direction_from(conn, src)
        dst = conn.socks[direction][1]
        try:
            data = src.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn, reset=True)  # a reset on one side is passed on to the other
            return
        if not data:
            conn.eof[direction] = True
            self._pass_fin(conn, direction)
            return
        data = bytearray(data)
        reset_at = self._apply_faults(conn, direction, data)
        if reset_at is not None:
            conn.out[dst] += data[:reset_at]
            self._drain(conn, dst, 1.0)
            self.forwarded[direction] += reset_at
            self._close(conn, reset=True)
            self._fired.set()
            return
        conn.out[dst] += data
        self.forwarded[direction] += len(data)
        self._write(conn, dst)

    def _apply_faults(self, conn, direction, data):
        """Applies this direction's armed fault to `data` (in place); returns where to cut the
        stream and reset, or None."""
        stream = conn.streams[direction]
        start = stream.pos
        headers = stream.frames(bytes(data))
        with self._lock:
            fault = self._faults[direction]
            if fault is None and stream.flip_pos is None:
                return None
            if fault is not None and fault["kind"] == "flip_payload":
                for payload_at, ftype, length in headers:
                    if ftype == DATA_FRAME and length > fault["offset"] and payload_at - HEADER_BYTES >= start:
                        stream.flip_pos = (payload_at + fault["offset"], fault["mask"])
                        self._faults[direction] = None
                        break
                fault = None
            if stream.flip_pos is not None:
                at, mask = stream.flip_pos
                if start <= at < start + len(data):
                    data[at - start] ^= mask
                    stream.flip_pos = None
                    self.log.append("%s: flipped byte %d of the stream (mask 0x%02x)" % (direction, at, mask))
                    self._fired.set()
            if fault is None:
                return None
            if fault["left"] >= len(data):
                fault["left"] -= len(data)
                return None
            self._faults[direction] = None
            if fault["kind"] == "flip":
                data[fault["left"]] ^= fault["mask"]
                self.log.append("%s: flipped byte %d of the stream (mask 0x%02x)"
                                % (direction, start + fault["left"], fault["mask"]))
                self._fired.set()
                return None
            self.log.append("%s: reset after byte %d of the stream" % (direction, start + fault["left"]))
            return fault["left"]

    def _write(self, conn, dst):
        buf = conn.out[dst]
        while buf:
            try:
                n = dst.send(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn, reset=True)
                return
            del buf[:n]
        for direction in DIRECTIONS:
            if conn.socks[direction][1] is dst:
                self._pass_fin(conn, direction)

    def _pass_fin(self, conn, direction):
        """Once `direction`'s source said FIN and everything it sent is written, FIN its
        destination; when both directions are done, close the connection."""
        dst = conn.socks[direction][1]
        if conn.eof[direction] and not conn.out[dst] and not conn.shut[direction]:
            conn.shut[direction] = True
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if all(conn.shut.values()):
            self._close(conn, reset=False)

    def _drain(self, conn, dst, timeout):
        """Writes what waits for `dst`, for up to `timeout` seconds (before a reset)."""
        deadline = time.monotonic() + timeout
        buf = conn.out[dst]
        while buf and time.monotonic() < deadline:
            try:
                del buf[:dst.send(buf)]
            except (BlockingIOError, InterruptedError):
                time.sleep(0.001)
            except OSError:
                return

    def _close(self, conn, reset):
        if conn.closed:
            return
        conn.closed = True
        for s in conn.socks["c2s"]:
            try:
                conn.sel.unregister(s)
            except (KeyError, ValueError):
                pass
            if reset:
                _reset(s)
            else:
                s.close()


def _reset(sock):
    """Close with SO_LINGER 0: the peer gets an RST."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError as e:
        if e.errno not in (errno.EBADF, errno.ENOTCONN, errno.EINVAL):
            raise
    sock.close()
