"""PD disaggregation: ship finished KV pages (from L1 or straight from L2) to a decode peer.

Modules: `engine` (the one adapter over Mooncake's TransferEngine),
`control` (the JSON control channel and its authkey rule), `registration`
(what each side registers, and the compatibility check), `room` (per-request
transfer state machine with deadlines and the drain before reclaim), `plan`
(page homes and coalesced descriptors), `feeder` (per-layer submissions off
the forward's thread), `result` (a room's outcome, the partition dump), `sender` (prefill side, `PdSender`). The decode peer
that receives and verifies every byte is `hicache_harness.decode_peer`.
Mooncake is imported lazily, so importing this package does not need it.
"""

from hicache_cp.pd.registration import RegistrationDescriptor, RegistrationMismatch, check_compatible
from hicache_cp.pd.room import Room, RoomFailed, RoomState, RoomTable

__all__ = ["RegistrationDescriptor", "RegistrationMismatch", "Room", "RoomFailed", "RoomState", "RoomTable",
           "check_compatible"]
