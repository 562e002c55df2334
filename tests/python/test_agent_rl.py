"""The agent-RL example (clients/python/examples/agent_rl.py) with its short profile: 2 trainers
through 2 real sidecars, tasks and rollouts through the store stand-in
(clients/python/examples/agent_store.py). Checks what the run leaves behind: every rollout handed
out once and finished once, one gradient request per optimizer step and trainer (micro-batches
accumulated), the rewards reported, every layer exchanged at every step."""

import json
import os
import subprocess
import sys
import threading

import pytest

pytest.importorskip("torch")

from conftest import metric_total  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "clients", "python", "examples")
TRAINER = os.path.join(EXAMPLES, "agent_rl.py")
sys.path.insert(0, EXAMPLES)

from agent_store import StoreClient, StoreServer  # noqa: E402


def run_example(cl, tmp_path, *extra, steps=6):
    out = tmp_path / "run.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "clients", "python"),
               OPENBLAS_NUM_THREADS="1")
    env.pop("LIGHTWIRE_BIN", None)
    proc = subprocess.run(
        [sys.executable, TRAINER, "--sockets", ",".join(sc.socket for sc in cl.sidecars),
         "--profile", "short", "--steps", str(steps), "--eval-every", "3", "--cache-dir",
         str(tmp_path / "cache"), "--out", str(out)] + list(extra),
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + cl.stderr()
    with open(out) as f:
        return json.load(f), proc.stdout


@pytest.mark.parametrize("transport,accum,task", [("http", 2, "reverse"), ("shm", 1, "add")])
def test_short_profile_two_trainers_two_sidecars(cluster_factory, tmp_path, transport, accum,
                                                 task):
    cl = cluster_factory(2, codec="dgc", codec_args=["--density", "0.05"])
    steps = 6
    result, text = run_example(cl, tmp_path, "--transport", transport, "--accum", str(accum),
                               "--task", task, steps=steps)
    cfg, summary = result["config"], result["summary"]
    # The store: every task handed out once and finished once, a span per completion.
    tasks = steps * 2 * cfg["prompts"]
    assert summary["store"] == {"rollouts": tasks, "by_status": {"succeeded": tasks},
                                "spans": tasks * cfg["group"], "rejected": 0}, summary["store"]
    assert "store: %d rollouts, %d succeeded" % (tasks, tasks) in text
    # Rank 0 evaluated at steps 0, 3 and 6; every trainer ran every step.
    assert [e["step"] for e in result["ranks"][0]["evals"]] == [0, 3, 6]
    for rank in result["ranks"]:
        assert [r["step"] for r in rank["rows"]] == list(range(1, steps + 1))
        assert all(0.0 <= r["reward"] <= 1.0 for r in rank["rows"])
    layers = len(result["layout"])
    assert layers > 10  # the whole model, a tensor per parameter
    for sc in cl.sidecars:
        text = sc.client().metrics()
        # One gradient request per optimizer step (micro-batches accumulated in the trainer),
        # every layer a step of its own, one reward report per step, each answered 200.
        assert metric_total(text, "lightwire_http_requests_total",
                            'code="200",route="/v1/emit_gradient"') == steps
        assert metric_total(text, "lightwire_steps_total", 'result="ok"') == steps * layers
        assert metric_total(text, "lightwire_http_requests_total",
                            'code="200",route="/v1/report"') == steps
        # The reward gauge holds a reported reward (0 to 1 here).
        assert 0.0 <= metric_total(text, "lightwire_reward") <= 1.0
    # dgc sent far fewer bytes than the dense gradient.
    assert 0 < summary["wire_bytes_per_step"] < summary["raw_bytes_per_step"] / 4


def test_tasks_held_out_apart_and_the_reverse_corpus_mixes_conventions():
    import random
    import agent_rl as A
    for task, example in (("reverse", ("abcd=", "dcba.")), ("add", ("47+38=", "085.")),
                          ("compare", ("47?38=", ">."))):
        cfg = dict(A.PROFILES["short"], task=task, eval_prompts=200)
        x = "abcd" if task == "reverse" else (47, 38)
        assert A.format_problem(x, cfg) == example
        held = A.eval_set(cfg)
        assert len(held) == 200 and held == A.eval_set(cfg)  # fixed, seed-independent
        rng = random.Random(0)
        train = {A.problem(rng, cfg)[0] for _ in range(2000)}
        assert not train & {p for p, _ in held}  # never a training prompt
        assert A.context(cfg) == sum(len(t) for t in example)
        assert A.answer_length(cfg) == len(example[1])
    # The reverse task's warm corpus: copied at copy_share, reversed otherwise.
    cfg = dict(A.PROFILES["short"], task="reverse", copy_share=0.65)
    rng = random.Random(1)
    copied = reversed_ = 0
    for _ in range(4000):
        prompt, target = A.warm_example(rng, cfg)
        letters = prompt[:-1]
        assert target in (letters + ".", letters[::-1] + ".")
        copied += target == letters + "." and letters != letters[::-1]
        reversed_ += target == letters[::-1] + "." and letters != letters[::-1]
    assert 0.6 < copied / (copied + reversed_) < 0.7
    # Partial credit: the share of the answer's characters at the same place.
    assert A.reward("dcba.", "dcba.") == 1.0
    assert A.reward("abcd.", "dcba.") == 0.2
    assert A.reward("dcxx?", "dcba.") == 0.4


def test_store_refuses_a_rollout_finished_twice_or_unknown():
    server = StoreServer()
    try:
        c = StoreClient(server.url)
        ids = c.enqueue([{"step": 1, "input": {"prompt": "1+1=", "answer": "2"}}] * 3)
        assert len(ids) == 3
        assert c.dequeue("w", 2, 5) == []  # none enqueued for step 2
        got = c.dequeue("w", 1, 2)
        assert [a["rollout_id"] for a in got] == ids[:2]
        c.finish(got[0]["rollout_id"], got[0]["attempt_id"], 0.5)
        with pytest.raises(RuntimeError, match="409.*finished once only"):
            c.finish(got[0]["rollout_id"], got[0]["attempt_id"], 0.5)
        with pytest.raises(RuntimeError, match="404.*unknown attempt"):
            c.finish(ids[2], "at-x", 1.0)  # not handed out
        with pytest.raises(RuntimeError, match="409.*not running"):
            c.add_spans(got[0]["rollout_id"], got[0]["attempt_id"], [{"name": "late"}])
        stats = c.stats()
        assert stats["by_status"] == {"succeeded": 1, "running": 1, "queuing": 1}
        assert stats["rejected"] == 3
        # Concurrent runners never get the same rollout.
        more = c.enqueue([{"step": 3, "input": {}}] * 40)
        seen, lock = [], threading.Lock()

        def runner(w):
            cc = StoreClient(server.url)
            while True:
                a = cc.dequeue("w%d" % w, 3, 3)
                if not a:
                    break
                with lock:
                    seen.extend(x["rollout_id"] for x in a)
            cc.close()
        threads = [threading.Thread(target=runner, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(seen) == sorted(more)
        c.close()
    finally:
        server.close()


def test_store_refuses_bad_bodies_and_changes_nothing():
    import http.client
    from agent_store import MAX_BODY
    server = StoreServer()
    try:
        port = int(server.url.rsplit(":", 1)[1])

        def post(path, body, length=None):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            headers = {"Content-Length": str(len(body) if length is None else length)}
            conn.putrequest("POST", path)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            if length is None:
                conn.send(body)
            resp = conn.getresponse()
            out = (resp.status, json.loads(resp.read() or b"{}"))
            conn.close()
            return out

        assert post("/v1/agl/rollouts", b"{not json")[0] == 400
        assert post("/v1/agl/rollouts", b"[1, 2]")[0] == 400
        assert post("/v1/agl/rollouts", b'{"tasks": 5}')[0] == 400
        assert post("/v1/agl/dequeue", b'{"step": 1}')[0] == 400  # no worker_id
        assert post("/v1/agl/nowhere", b"{}")[0] == 404
        code, doc = post("/v1/agl/rollouts", b"", length=MAX_BODY + 1)  # refused before reading
        assert code == 413 and "at most" in doc["error"]
        stats = StoreClient(server.url).stats()
        assert stats["rollouts"] == 0 and stats["spans"] == 0
    finally:
        server.close()
