"""A vLLM-like prefill engine (P) written with pyzmq + msgspec, for kvrecv's interop test.

The structs are written from PROTOCOL.md §2.3-2.4 (the connector's declarations). Two workers
(TP2, PP1) each bind a ROUTER; a bootstrap server answers GET /query. Behaviour is chosen by
the D request ids of a pull (worker 0 misbehaves, worker 1 is healthy):

  err-*   worker 0: peer-wide ERROR without err_reqs at once; worker 1 holds its FINISH until
          a "release" line arrives on stdin (so D sees the ERROR while worker 1 is pending)
  omit-*  worker 0: FINISH naming only ids that do not end in "-b" (silent omission)
  garb-*  worker 0: a garbage frame instead of msgpack
  stray-* worker 0: first a FINISH naming only its previous pull's ids (err_reqs; a duplicate of
          an earlier exchange reaching the connection D reuses), then FINISH ok_reqs=all
  other   both: FINISH ok_reqs=all

Worker 0 also counts pulls that came on a connection (DEALER identity) it had seen before
(`reused`) and those that came on one it had sent a stray message to (`reused_after_stray`).

stdout: one JSON "ready" line; on "quit" a "done" line with counters and protocol violations
by D (a message that is not exactly [identity, payload], undecodable metadata).
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import zmq


from mooncake_structs import (
    MooncakeXferMetadata,
    MooncakeXferResponse,
    MooncakeXferResponseStatus,
)


ENGINE = "py-prefill"
decoder = msgspec.msgpack.Decoder(MooncakeXferMetadata)
encoder = msgspec.msgpack.Encoder()
release = threading.Event()
lock = threading.Lock()
stats = {"pulls": 0, "violations": [], "reused": 0, "reused_after_stray": 0}
seen, strayed = set(), set()  # worker 0's DEALER identities
last_ids = []  # worker 0's previous pull


def note_violation(msg):
    with lock:
        stats["violations"].append(msg)


def serve(ctx, rank, sock):
    while True:
        try:
            frames = sock.recv_multipart()
        except zmq.ContextTerminated:
            return
        if len(frames) != 2:
            note_violation(f"worker {rank}: {len(frames)}-frame message")
            continue
        identity, payload = frames
        try:
            md = decoder.decode(payload)
        except msgspec.ValidationError as e:
            note_violation(f"worker {rank}: undecodable metadata: {e}")
            sock.send_multipart([identity, encoder.encode(MooncakeXferResponse(status=MooncakeXferResponseStatus.ERROR, err_msg=str(e)))])
            continue
        with lock:
            stats["pulls"] += 1
        if len(md.kv_caches_base_addr) != len(md.block_lens) or md.remote_tp_size != 1:
            note_violation(f"worker {rank}: unexpected metadata {md}")
        ids = sorted(md.req_blocks)
        kind = ids[0].split("-")[0] if ids else ""
        if rank == 0:
            with lock:
                stats["reused"] += identity in seen
                stats["reused_after_stray"] += identity in strayed
                seen.add(identity)
                if kind == "stray":
                    strayed.add(identity)
                previous = list(last_ids)
                last_ids[:] = ids
            if kind == "stray":
                send(sock, identity, encoder.encode(MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, err_reqs=previous, err_msg="stray")))
        threading.Thread(target=answer, args=(sock, rank, identity, kind, ids), daemon=True).start()


send_lock = threading.Lock()


def send(sock, identity, body):
    # pyzmq sockets are not thread-safe: one sender at a time.
    with send_lock:
        sock.send_multipart([identity, body])


def answer(sock, rank, identity, kind, ids):
    ok = lambda reqs: encoder.encode(MooncakeXferResponse(status=MooncakeXferResponseStatus.FINISH, ok_reqs=reqs or None))
    if rank == 0 and kind == "err":
        send(sock, identity, encoder.encode(MooncakeXferResponse(status=MooncakeXferResponseStatus.ERROR, err_msg="Traceback: simulated exception")))
    elif rank == 1 and kind == "err":
        release.wait()
        send(sock, identity, ok(ids))
    elif rank == 0 and kind == "omit":
        send(sock, identity, ok([i for i in ids if not i.endswith("-b")]))
    elif rank == 0 and kind == "garb":
        send(sock, identity, b"\xc1\xc1 not msgpack")
    else:
        send(sock, identity, ok(ids))


def main():
    ctx = zmq.Context()
    workers = {}
    for rank in range(2):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        workers[rank] = (sock, f"tcp://127.0.0.1:{port}")

    query = {"0": {"engine_id": ENGINE, "worker_addr": {str(r): {"0": a} for r, (_, a) in workers.items()}}}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/query":
                self.send_error(404)
                return
            body = json.dumps(query).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    for rank, (sock, _) in workers.items():
        threading.Thread(target=serve, args=(ctx, rank, sock), daemon=True).start()
    print(json.dumps({"event": "ready", "engine_id": ENGINE, "bootstrap": f"http://127.0.0.1:{http.server_address[1]}",
                      "workers": [a for _, a in workers.values()]}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "release":
            release.set()
        elif cmd == "quit":
            break
    with lock:
        print(json.dumps({"event": "done", **stats}), flush=True)


if __name__ == "__main__":
    main()
