# Moved to bench/device/env.sh. tools/device_vllm.sh (and any tools/device_*.sh not yet moved
# to bench/device/) still source this path; it goes when they move.
# shellcheck source=bench/device/env.sh
source bench/device/env.sh
