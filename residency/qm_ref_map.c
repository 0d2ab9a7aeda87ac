/* qm_ref_map.c - the history map behind the run-time hooks: O(1) expected
 * per lookup, so choose_victim is O(n candidates). */
#include "qm_residency_impl.h"

#include <string.h>

#include "qm_alloc.h"

static uint64_t ref_hash(uint64_t x)
{
    /* splitmix64 finaliser: bank and expert ids are small and dense. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static qm__ref_entry *probe(qm__ref_entry *slots, size_t cap, uint64_t key)
{
    size_t mask = cap - 1;
    size_t i = (size_t)ref_hash(key) & mask;
    while (slots[i].used && slots[i].key != key)
        i = (i + 1) & mask;
    return &slots[i];
}

int qm__ref_map_reserve(qm__ref_map *map, size_t n)
{
    if (n > QM__REF_MAP_MAX_KEYS) n = QM__REF_MAP_MAX_KEYS;
    size_t want = 16;
    while (want < 2 * n) /* load factor <= 1/2 keeps probes short */
        want *= 2;
    if (want <= map->cap) return 0;
    qm__ref_entry *slots = qm_calloc(want, sizeof *slots);
    if (!slots) return QM_ENOMEM;
    for (size_t i = 0; i < map->cap; i++)
        if (map->slots[i].used) *probe(slots, want, map->slots[i].key) = map->slots[i];
    qm_free(map->slots);
    map->slots = slots;
    map->cap = want;
    return 0;
}

qm__ref_entry *qm__ref_map_find(const qm__ref_map *map, uint64_t key)
{
    if (!map->cap) return NULL;
    qm__ref_entry *e = probe(map->slots, map->cap, key);
    return e->used ? e : NULL;
}

qm__ref_entry *qm__ref_map_upsert(qm__ref_map *map, uint64_t key)
{
    qm__ref_entry *e = qm__ref_map_find(map, key);
    if (e) return e;
    if (map->len >= QM__REF_MAP_MAX_KEYS) return NULL;
    if (qm__ref_map_reserve(map, map->len + 1) != 0) return NULL;
    e = probe(map->slots, map->cap, key);
    memset(e, 0, sizeof *e);
    e->key = key;
    e->used = 1;
    map->len++;
    return e;
}

void qm__ref_map_free(qm__ref_map *map)
{
    if (!map) return;
    qm_free(map->slots);
    memset(map, 0, sizeof *map);
}
