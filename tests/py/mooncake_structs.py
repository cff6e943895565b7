"""vLLM MooncakeConnector's control-plane structs, written from PROTOCOL.md §2.3-§2.4
(msgspec, omit_defaults=True, map form). Shared by the Python test peers."""

from enum import IntEnum
from typing import Optional

import msgspec


class MooncakeXferMetadata(msgspec.Struct, omit_defaults=True):
    remote_hostname: str
    remote_port: int
    remote_tp_size: int
    remote_tp_rank: int
    req_blocks: dict[str, tuple[str, list[list[int]]]]
    kv_caches_base_addr: list[int]
    block_lens: list[int]
    kv_block_lens: list[int]
    registered_layer_names: list[str] = []
    registered_layer_indices: list[int] = []
    registered_group_indices: list[int] = []
    remote_pp_size: int = 1
    prefix_replay_protocol: int = 0
    prefix_replay_layout: Optional[str] = None
    prefix_replay_checkpoints: dict[str, tuple[int, int, str]] = {}


class MooncakeXferResponseStatus(IntEnum):
    FINISH = 0
    CONTINUE = 1
    ERROR = 2


class MooncakeXferResponse(msgspec.Struct, omit_defaults=True):
    status: MooncakeXferResponseStatus
    ok_reqs: Optional[list[str]] = None
    err_reqs: Optional[list[str]] = None
    err_msg: Optional[str] = None
    prefix_replay_checkpoints: Optional[dict[str, tuple[int, str]]] = None
