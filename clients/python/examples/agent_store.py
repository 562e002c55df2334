"""A stand-in for an agent-RL task store (the part of Agent-Lightning's LightningStore the example
trainer needs), over HTTP on 127.0.0.1, standard library only.

It is not Agent-Lightning and does not try to be: no resources, no retries of failed attempts, no
OpenTelemetry spans, no persistence. It does what the example's loop needs from a store, with the
same shape of calls: the algorithm enqueues tasks (rollouts), runners dequeue them (an attempt
each), record spans (here: one per sampled completion, with its text and reward) and finish the
attempt with its reward; the algorithm queries what finished. docs/agent-rl.md "The store" maps
each route to the LightningStore method it stands for:

    POST /v1/agl/rollouts            {"tasks": [{"input": {...}, "step": s}, ...]}  enqueue_rollout
                                     -> {"rollout_ids": [...]}
    POST /v1/agl/dequeue             {"worker_id": w, "step": s, "limit": n}       dequeue_rollout
                                     -> {"attempts": [{"rollout_id", "attempt_id", "input"}, ...]}
    POST /v1/agl/spans               {"rollout_id", "attempt_id", "spans": [...]}   add_span
    POST /v1/agl/attempts/finish     {"rollout_id", "attempt_id", "reward"}         update_attempt
                                                                        ("finished") with its reward
    GET  /v1/agl/rollouts?status=S&step=s                                          query_rollouts
    GET  /v1/agl/stats               counts by status, spans, rejected calls

A task is enqueued for one optimizer step (`step`): a runner asks for the tasks of the step it is
at, as an RL trainer asks for rollouts made with the current policy version. Every rollout is
handed out once and finished once: finishing one twice, or one not handed out, or an unknown
attempt is refused (409/404) and counted in `rejected`, so the accounting catches a rollout lost
or counted twice.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

MAX_BODY = 8 << 20  # bytes: a request body larger is refused (413)


class Store(object):
    """The store's state; every method holds the lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rollouts = {}  # id -> dict(input, step, status, attempt_id, worker, reward, spans)
        self.queues = {}  # step -> [rollout ids waiting, in enqueue order]
        self.next_id = 0
        self.rejected = 0
        self.spans = 0

    def enqueue(self, tasks):
        ids = []
        with self.lock:
            for t in tasks:
                rid = "ro-%d" % self.next_id
                self.next_id += 1
                step = int(t.get("step", 0))
                self.rollouts[rid] = {"input": t.get("input", {}), "step": step,
                                      "status": "queuing", "attempt_id": None, "worker": None,
                                      "reward": None, "spans": []}
                self.queues.setdefault(step, []).append(rid)
                ids.append(rid)
        return ids

    def dequeue(self, worker, step, limit):
        out = []
        with self.lock:
            q = self.queues.get(step, [])
            while q and len(out) < limit:
                rid = q.pop(0)
                r = self.rollouts[rid]
                r["status"] = "running"
                r["attempt_id"] = "at-%s" % rid[3:]
                r["worker"] = worker
                out.append({"rollout_id": rid, "attempt_id": r["attempt_id"],
                            "input": r["input"]})
        return out

    def _running(self, rid, aid, why):
        """The rollout of a running attempt (lock held), or (None, (code, error)): an unknown
        attempt 404, a rollout not running 409 ("... `why`"); either is counted as refused."""
        r = self.rollouts.get(rid)
        if r is None or r["attempt_id"] != aid:
            self.rejected += 1
            return None, (404, "unknown attempt %r of rollout %r" % (aid, rid))
        if r["status"] != "running":
            self.rejected += 1
            return None, (409, "rollout %s is %s%s" % (rid, r["status"], why))
        return r, None

    def add_spans(self, rid, aid, spans):
        with self.lock:
            r, err = self._running(rid, aid, ", not running")
            if err:
                return err
            r["spans"].extend(spans)
            self.spans += len(spans)
        return 200, None

    def finish(self, rid, aid, reward):
        with self.lock:
            r, err = self._running(rid, aid, ": finished once only")
            if err:
                return err
            r["status"] = "succeeded"
            r["reward"] = float(reward)
        return 200, None

    def query(self, status=None, step=None):
        with self.lock:
            return [dict(rollout_id=rid, step=r["step"], status=r["status"], worker=r["worker"],
                         reward=r["reward"], spans=len(r["spans"]))
                    for rid, r in self.rollouts.items()
                    if (status is None or r["status"] == status)
                    and (step is None or r["step"] == step)]

    def stats(self):
        with self.lock:
            by = {}
            for r in self.rollouts.values():
                by[r["status"]] = by.get(r["status"], 0) + 1
            return {"rollouts": len(self.rollouts), "by_status": by, "spans": self.spans,
                    "rejected": self.rejected}


def _handler(store):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _reply(self, code, doc):
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self):
            try:
                n = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                n = -1
            if n < 0 or n > MAX_BODY:
                self._reply(413, {"error": "body of %s bytes (at most %d)" % (n, MAX_BODY)})
                self.close_connection = True
                return None
            try:
                doc = json.loads(self.rfile.read(n) or b"{}")
            except ValueError as e:
                self._reply(400, {"error": "not JSON: %s" % e})
                return None
            if not isinstance(doc, dict):
                self._reply(400, {"error": "the body must be a JSON object"})
                return None
            return doc

        def do_GET(self):
            u = urlparse(self.path)
            q = parse_qs(u.query)
            if u.path == "/v1/agl/stats":
                return self._reply(200, store.stats())
            if u.path == "/v1/agl/rollouts":
                step = int(q["step"][0]) if "step" in q else None
                status = q["status"][0] if "status" in q else None
                return self._reply(200, {"items": store.query(status, step)})
            self._reply(404, {"error": "no route %s" % u.path})

        def do_POST(self):
            doc = self._body()
            if doc is None:
                return
            try:
                if self.path == "/v1/agl/rollouts":
                    return self._reply(200, {"rollout_ids": store.enqueue(doc["tasks"])})
                if self.path == "/v1/agl/dequeue":
                    got = store.dequeue(str(doc["worker_id"]), int(doc["step"]),
                                        int(doc.get("limit", 1)))
                    return self._reply(200, {"attempts": got})
                if self.path == "/v1/agl/spans":
                    code, err = store.add_spans(doc["rollout_id"], doc["attempt_id"],
                                                list(doc["spans"]))
                elif self.path == "/v1/agl/attempts/finish":
                    code, err = store.finish(doc["rollout_id"], doc["attempt_id"],
                                             float(doc["reward"]))
                else:
                    return self._reply(404, {"error": "no route %s" % self.path})
            except (KeyError, TypeError, ValueError) as e:
                return self._reply(400, {"error": "bad request: %r" % (e,)})
            self._reply(code, {"ok": code == 200} if err is None else {"error": err})

    return Handler


class StoreServer(object):
    """The store on 127.0.0.1 (port 0: any free one), served by a thread of this process."""

    def __init__(self, port=0):
        self.store = Store()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self.store))
        self.httpd.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class StoreClient(object):
    """A runner's or the algorithm's side: one keep-alive connection."""

    def __init__(self, url, timeout=30.0):
        import http.client
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)

    def _call(self, method, path, doc=None):
        body = None if doc is None else json.dumps(doc).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        self.conn.request(method, path, body=body, headers=headers)
        resp = self.conn.getresponse()
        out = json.loads(resp.read() or b"{}")
        if resp.status != 200:
            raise RuntimeError("store %s %s: %d %s" % (method, path, resp.status,
                                                       out.get("error")))
        return out

    def enqueue(self, tasks):
        return self._call("POST", "/v1/agl/rollouts", {"tasks": tasks})["rollout_ids"]

    def dequeue(self, worker_id, step, limit):
        return self._call("POST", "/v1/agl/dequeue", {"worker_id": worker_id, "step": step,
                                                      "limit": limit})["attempts"]

    def add_spans(self, rollout_id, attempt_id, spans):
        self._call("POST", "/v1/agl/spans", {"rollout_id": rollout_id, "attempt_id": attempt_id,
                                             "spans": spans})

    def finish(self, rollout_id, attempt_id, reward):
        self._call("POST", "/v1/agl/attempts/finish", {"rollout_id": rollout_id,
                                                       "attempt_id": attempt_id,
                                                       "reward": reward})

    def query(self, status=None, step=None):
        q = []
        if status is not None:
            q.append("status=%s" % status)
        if step is not None:
            q.append("step=%d" % step)
        return self._call("GET", "/v1/agl/rollouts" + ("?" + "&".join(q) if q else ""))["items"]

    def stats(self):
        return self._call("GET", "/v1/agl/stats")

    def close(self):
        self.conn.close()
