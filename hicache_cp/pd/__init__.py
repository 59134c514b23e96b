"""PD disaggregation: ship finished KV pages (from L1 or straight from L2) to a decode peer.

Modules: `engine` (the one adapter over Mooncake's TransferEngine),
`registration` (what each side registers, and the compatibility check),
`room` (per-request transfer state machine with deadlines), `sender`
(prefill side, `PdSender`), `decode_peer` (receiver that verifies every
byte), `bench` (`hicache-cp bench-pd`). Mooncake is imported lazily, so
importing this package does not need it.
"""

from hicache_cp.pd.registration import RegistrationDescriptor, RegistrationMismatch, check_compatible
from hicache_cp.pd.room import Room, RoomFailed, RoomState, RoomTable

__all__ = ["RegistrationDescriptor", "RegistrationMismatch", "Room", "RoomFailed", "RoomState", "RoomTable",
           "check_compatible"]
