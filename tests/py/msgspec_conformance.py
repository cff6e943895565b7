"""msgspec side of the msgpack conformance test (PROTOCOL.md §2.3-§2.5).

Struct definitions are written from PROTOCOL.md, as vLLM's connector declares them
(omit_defaults=True, map form). Reads a JSON object on stdin:
  {"rust": [{"kind": "metadata"|"response", "hex": "..."}]}
and prints one JSON object:
  {"rust": [{"ok": bool, "error": str|null, "reencoded": hex|null}],
   "python": [{"kind": ..., "hex": ..., "valid": bool, "what": str}]}
"""
import json
import sys

import msgspec


from mooncake_structs import MooncakeXferMetadata, MooncakeXferResponse
from mooncake_structs import MooncakeXferResponseStatus as Status

import mooncake_structs_033 as v033

TYPES = {
    "metadata": MooncakeXferMetadata,
    "response": MooncakeXferResponse,
    # vLLM 0.33.0's own definitions (layout ids, LAYOUT_MISS)
    "metadata033": v033.MooncakeXferMetadata,
    "response033": v033.MooncakeXferResponse,
}
enc = msgspec.msgpack.Encoder()
raw = msgspec.msgpack.Encoder()  # for hand-built (possibly invalid) documents


def check_rust(item):
    t = TYPES[item["kind"]]
    data = bytes.fromhex(item["hex"])
    try:
        obj = msgspec.msgpack.decode(data, type=t)
    except msgspec.ValidationError as e:
        return {"ok": False, "error": str(e), "reencoded": None}
    except msgspec.DecodeError as e:
        return {"ok": False, "error": str(e), "reencoded": None}
    return {"ok": True, "error": None, "reencoded": enc.encode(obj).hex()}


def python_vectors():
    out = []

    def add(kind, data, valid, what):
        out.append({"kind": kind, "hex": data.hex(), "valid": valid, "what": what})

    R = MooncakeXferResponse
    add("response", enc.encode(R(status=Status.FINISH, ok_reqs=["r1"])), True, "finish ok")
    add("response", enc.encode(R(status=Status.CONTINUE)), True, "continue")
    add("response", enc.encode(R(status=Status.ERROR, err_msg="x")), True, "error")
    add("response", enc.encode(R(status=Status.FINISH, err_reqs=["d-1"], err_msg="Timeout waiting for P side ready.")), True, "readiness timeout")
    add("response", enc.encode(R(status=Status.CONTINUE, ok_reqs=["a", "b"], err_reqs=["c"], err_msg="Mooncake transfer engine returned -1", prefix_replay_checkpoints={"a": (1, "x")})), True, "with replay checkpoints")
    add("response", raw.encode({"status": 0, "ok_reqs": None, "err_reqs": [], "zzz": 1}), True, "nil, empty, unknown key")
    add("response", raw.encode([0, ["r1"]]), False, "array form")
    add("response", raw.encode({"status": None}), False, "nil for int")
    add("response", raw.encode({"status": 3}), False, "status 3")
    add("response", raw.encode({"status": True}), False, "bool for int")
    add("response", raw.encode({"status": 0.0}), False, "float for int")
    add("response", raw.encode({"status": 0, "ok_reqs": [b"r1"]}), False, "bin for str")
    add("response", raw.encode({"ok_reqs": ["r1"]}), False, "missing status")
    M = MooncakeXferMetadata
    md = M(remote_hostname="10.0.0.7", remote_port=15000, remote_tp_size=1, remote_tp_rank=0,
           req_blocks={"d-1": ("t-1", [[5, 6]])}, kv_caches_base_addr=[0x7E0000000000],
           block_lens=[4096], kv_block_lens=[4096],
           registered_layer_names=["model.layers.0.self_attn.attn"],
           registered_layer_indices=[0], registered_group_indices=[0])
    add("metadata", enc.encode(md), True, "realistic 269 bytes")
    add("metadata", enc.encode(M(remote_hostname="h", remote_port=1, remote_tp_size=1, remote_tp_rank=0, req_blocks={}, kv_caches_base_addr=[], block_lens=[], kv_block_lens=[], remote_pp_size=2)), True, "pp2")
    good = msgspec.to_builtins(md)
    bad = dict(good); bad["remote_port"] = True
    add("metadata", raw.encode(bad), False, "bool for int")
    bad = dict(good); bad["remote_hostname"] = b"10.0.0.7"
    add("metadata", raw.encode(bad), False, "bin for str")
    bad = dict(good); bad["req_blocks"] = {"d-1": ["t-1", [[5]], 1]}
    add("metadata", raw.encode(bad), False, "tuple of wrong length")
    bad = dict(good); bad["req_blocks"] = {"d-1": ["t-1", [5, 6]]}
    add("metadata", raw.encode(bad), False, "flat block list")
    bad = dict(good); bad["remote_pp_size"] = None
    add("metadata", raw.encode(bad), False, "nil for remote_pp_size")
    add("metadata", raw.encode(list(good.values())), False, "array form")

    # vLLM 0.33.0
    R3, M3, S3 = v033.MooncakeXferResponse, v033.MooncakeXferMetadata, v033.MooncakeXferResponseStatus
    lid = 0x5A5A_1234_5678_9ABD
    add("response033", enc.encode(R3(status=S3.CONTINUE, ok_reqs=["a"], layout_id=lid)), True, "0.33 continue echoing the id")
    add("response033", enc.encode(R3(status=S3.FINISH, ok_reqs=["r1"], err_reqs=["r2"], err_msg="Mooncake transfer engine returned -1", layout_id=lid)), True, "0.33 finish echoing the id")
    add("response033", enc.encode(R3(status=S3.FINISH, err_reqs=["d-1"], err_msg="Timeout waiting for P side ready.", layout_id=lid)), True, "0.33 readiness timeout echoing the id")
    add("response033", enc.encode(R3(status=S3.LAYOUT_MISS, err_msg=f"Mooncake KV layout {lid:#x} from 10.0.0.7:15000 is not cached.")), True, "0.33 layout miss")
    add("response033", enc.encode(R3(status=S3.ERROR, err_msg="x")), True, "0.33 error")
    add("response033", enc.encode(R3(status=S3.FINISH)), True, "0.33 finish, no id")
    add("response033", raw.encode({"status": 4}), False, "0.33 status 4")
    add("response033", raw.encode({"status": 0, "layout_id": None}), False, "0.33 nil for layout_id")
    add("response033", raw.encode({"status": 0, "layout_id": "1"}), False, "0.33 str for layout_id")
    bare = M3(remote_hostname="10.0.0.7", remote_port=15000, remote_tp_size=1, remote_tp_rank=0,
              remote_pp_size=1, layout_id=lid, req_blocks={"d-1": ("t-1", [[5, 6]])},
              kv_caches_base_addr=[], block_lens=[], kv_block_lens=[])
    add("metadata033", enc.encode(bare), True, "0.33 pull without layout")
    full = M3(remote_hostname="10.0.0.7", remote_port=15000, remote_tp_size=2, remote_tp_rank=1,
              remote_pp_size=2, layout_id=lid, req_blocks={"d-1": ("t-1", [[5, 6]])},
              kv_caches_base_addr=[0x7E0000000000], block_lens=[4096], kv_block_lens=[4096],
              registered_layer_names=["model.layers.0.self_attn.attn"],
              registered_layer_indices=[0], registered_group_indices=[0],
              registered_shared_group_ids=[[0]], registered_row_offsets=[-1])
    add("metadata033", enc.encode(full), True, "0.33 pull with layout and id")
    return out


def main():
    req = json.load(sys.stdin)
    json.dump({"rust": [check_rust(i) for i in req["rust"]], "python": python_vectors()}, sys.stdout)


if __name__ == "__main__":
    main()
