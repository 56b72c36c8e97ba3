/* XXH3-64 (seed 0, default secret), written from the published XXH3 algorithm description.
 *
 * The hash is a "cursor" over one contiguous buffer whose final length is known up front: the caller
 * feeds it the growing prefix that has landed so far (kvf_xxh3_update) and the state consumes every
 * 64-byte stripe that can no longer be the last one, so a file can be hashed piece by piece while it is
 * read or written, with no copy into an internal buffer. kvf_xxh3_64 is the one-shot form. */
#ifndef KVF_XXH3_H
#define KVF_XXH3_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t acc[8];
    const uint8_t *base;  /* start of the buffer being hashed */
    size_t len;           /* its final length */
    size_t stripes_done;  /* stripes of the long-input loop consumed so far */
    size_t stripes_total; /* (len - 1) / 64 for len > 240 */
} kvf_xxh3_state;

/* 0 = scalar, 1 = AVX2, 2 = AVX-512F. kvf_xxh3_select(-1) picks the widest the CPU supports; a path the
 * CPU lacks falls back to the next narrower one. Returns the path in use. */
int kvf_xxh3_select(int path);
int kvf_xxh3_path(void);
int kvf_xxh3_have_avx2(void);
int kvf_xxh3_have_avx512(void);

uint64_t kvf_xxh3_64(const void *data, size_t len);
void kvf_xxh3_init(kvf_xxh3_state *s, const void *base, size_t len);
/* The first `avail` bytes of the buffer are final: consume what can be consumed. */
void kvf_xxh3_update(kvf_xxh3_state *s, size_t avail);
/* All `len` bytes are final: the digest. */
uint64_t kvf_xxh3_digest(kvf_xxh3_state *s);
#endif
