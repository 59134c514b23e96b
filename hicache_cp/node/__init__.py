"""The node tier's pieces that know the segment, not the cache (docs/node-tier.md).

    geometry   the byte map of a segment, its fingerprint and compatibility
    segment    NodeSegment: the opening protocol (join, adopt, clean) and the header
    journal    the directory of committed objects: commit, release
    share      which pages of a backup each rank writes into the node's one copy
    adopt      rebuild a tree of host copies from a journal

The cache's side (hooks into backups, commits, frees and loads) is
`hicache_cp.cache.node_tier`. The checksums of the segment's copies are the
restore checks' own (`hicache_cp.checksum`): each copy's table in the segment
is its `HostPool.sums`.
"""
