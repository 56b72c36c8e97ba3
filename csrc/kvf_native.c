/* kvformat._kvfnative: xxh3-64 and fused read/write + hash, GIL released for each whole call.
 *
 * Why native: python-xxhash holds the GIL, and hashing a payload after it was copied costs a second trip
 * through DRAM. Here a file range is moved in cache-sized pieces and each piece is hashed right after it
 * lands (read) or right before it leaves (write), while it is still in L2. I/O stays at the edges: the hash
 * takes buffers; the I/O functions take file descriptors and buffers, never paths. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "kvf_xxh3.h"

#define DEFAULT_PIECE (256 * 1024)

static PyObject *py_xxh3_64(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t h;
    if (b.len >= 4096) {  /* below that the GIL round trip costs more than the hash */
        Py_BEGIN_ALLOW_THREADS
        h = kvf_xxh3_64(b.buf, (size_t)b.len);
        Py_END_ALLOW_THREADS
    } else {
        h = kvf_xxh3_64(b.buf, (size_t)b.len);
    }
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static const char *const kPathNames[] = {"scalar", "avx2", "avx512"};

static PyObject *py_set_simd(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    int prev = kvf_xxh3_path(), want;
    if (!strcmp(name, "auto")) want = -1;
    else if (!strcmp(name, "scalar")) want = 0;
    else if (!strcmp(name, "avx2")) {
        if (!kvf_xxh3_have_avx2()) { PyErr_SetString(PyExc_ValueError, "this CPU has no AVX2"); return NULL; }
        want = 1;
    } else if (!strcmp(name, "avx512")) {
        if (!kvf_xxh3_have_avx512()) { PyErr_SetString(PyExc_ValueError, "this CPU has no AVX-512F"); return NULL; }
        want = 2;
    } else { PyErr_SetString(PyExc_ValueError, "expected 'auto', 'scalar', 'avx2' or 'avx512'"); return NULL; }
    kvf_xxh3_select(want);
    return PyUnicode_FromString(kPathNames[prev]);
}

static PyObject *py_simd(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(kPathNames[kvf_xxh3_path()]); }

static PyObject *py_have_avx2(PyObject *self, PyObject *noargs) { return PyBool_FromLong(kvf_xxh3_have_avx2()); }

static PyObject *py_have_avx512(PyObject *self, PyObject *noargs) { return PyBool_FromLong(kvf_xxh3_have_avx512()); }

/* Read exactly len bytes at off (short only at end of file). Returns bytes read or -errno. */
static ssize_t read_full(int fd, struct iovec *iov, int n, off_t off) {
    ssize_t total = 0;
    while (n > 0) {
        ssize_t r = preadv(fd, iov, n, off + total);
        if (r < 0) { if (errno == EINTR) continue; return -errno; }
        if (r == 0) break;
        total += r;
        while (n > 0 && (size_t)r >= iov->iov_len) { r -= iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (char *)iov->iov_base + r; iov->iov_len -= r; }
    }
    return total;
}

static ssize_t write_full(int fd, struct iovec *iov, int n, off_t off) {
    ssize_t total = 0;
    while (n > 0) {
        ssize_t r = pwritev(fd, iov, n, off + total);
        if (r < 0) { if (errno == EINTR) continue; return -errno; }
        if (r == 0) return -EIO;
        total += r;
        while (n > 0 && (size_t)r >= iov->iov_len) { r -= iov->iov_len; iov++; n--; }
        if (n > 0) { iov->iov_base = (char *)iov->iov_base + r; iov->iov_len -= r; }
    }
    return total;
}

static PyObject *os_error(int err) {
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

PyDoc_STRVAR(pread_hash_doc,
"pread_hash(fd, head, dst, offset, hash=True, piece=262144) -> (head_read, dst_read, xxh3 or None)\n\n"
"Read len(head) + len(dst) bytes from fd at offset into head then dst (one preadv for head and dst's first\n"
"piece, then piece by piece), hashing dst's bytes right after each piece lands. The hash is None when\n"
"hash is False or dst was not filled (end of file).");

/* The body of pread_hash, GIL not held: head then dst from fd at offset, dst hashed piece by piece as it lands.
 * Returns 0 or an errno; *hgot and *dgot the bytes read into each, *h the digest when do_hash and dst was filled. */
static int pread_hash_core(int fd, void *head, size_t hlen, void *dst, size_t dlen, off_t offset, int do_hash,
                           size_t piece, ssize_t *hgot_out, ssize_t *dgot_out, uint64_t *h_out) {
    ssize_t hgot = 0, dgot = 0;
    int err = 0;
    kvf_xxh3_state st;
    kvf_xxh3_init(&st, dst, dlen);
    size_t first = dlen < piece ? dlen : piece;
    struct iovec iov[2] = {{head, hlen}, {dst, first}};
    ssize_t r = read_full(fd, iov, 2, offset);
    if (r < 0) err = (int)-r;
    else {
        hgot = r < (ssize_t)hlen ? r : (ssize_t)hlen;
        dgot = r - hgot;
        if (do_hash) kvf_xxh3_update(&st, (size_t)dgot);
        off_t pos = offset + (off_t)hlen + dgot;
        while (!err && dgot == (ssize_t)first && (size_t)dgot < dlen) {
            size_t n = dlen - (size_t)dgot < piece ? dlen - (size_t)dgot : piece;
            struct iovec one = {(char *)dst + dgot, n};
            r = read_full(fd, &one, 1, pos);
            if (r < 0) { err = (int)-r; break; }
            dgot += r;
            pos += r;
            if (do_hash) kvf_xxh3_update(&st, (size_t)dgot);
            if ((size_t)r < n) break;
            first = (size_t)dgot;  /* keep looping while every piece came back whole */
        }
        if (!err && do_hash && (size_t)dgot == dlen) *h_out = kvf_xxh3_digest(&st);
    }
    *hgot_out = hgot;
    *dgot_out = dgot;
    return err;
}

static PyObject *py_pread_hash(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "head", "dst", "offset", "hash", "piece", NULL};
    int fd, do_hash = 1;
    Py_buffer head, dst;
    long long offset;
    Py_ssize_t piece = DEFAULT_PIECE;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iw*w*L|pn", names, &fd, &head, &dst, &offset, &do_hash, &piece))
        return NULL;
    if (piece < 4096) piece = 4096;
    ssize_t hgot = 0, dgot = 0;
    int err;
    uint64_t h = 0;
    Py_BEGIN_ALLOW_THREADS
    err = pread_hash_core(fd, head.buf, (size_t)head.len, dst.buf, (size_t)dst.len, (off_t)offset, do_hash,
                          (size_t)piece, &hgot, &dgot, &h);
    Py_END_ALLOW_THREADS
    Py_ssize_t dlen = dst.len;
    PyBuffer_Release(&head);
    PyBuffer_Release(&dst);
    if (err) return os_error(err);
    if (do_hash && dgot == dlen) return Py_BuildValue("nnK", (Py_ssize_t)hgot, (Py_ssize_t)dgot, (unsigned long long)h);
    return Py_BuildValue("nnO", (Py_ssize_t)hgot, (Py_ssize_t)dgot, Py_None);
}

PyDoc_STRVAR(read_file_hash_doc,
"read_file_hash(path, head, dst, hash=True, max_head=1052672, align=4096) -> (status, size, head_read, dst_read, xxh3)\n\n"
"The tier's whole read of one file in one GIL-free call: open (O_RDONLY | O_CLOEXEC | O_NONBLOCK), fstat, then,\n"
"for a regular file whose header region (size - len(dst)) is a positive multiple of align of at most max_head\n"
"bytes, pread_hash of that region into head and of the payload into dst, and close. status 0: read (xxh3 as in\n"
"pread_hash); 1: not a regular file (nothing read); 2: the size does not fit (nothing read); 3: head is smaller\n"
"than the header region (nothing read; size says how much is needed). An open that fails raises its OSError\n"
"with the path; a read error raises OSError.");

static PyObject *py_read_file_hash(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"path", "head", "dst", "hash", "max_head", "align", NULL};
    PyObject *path = NULL;
    Py_buffer head, dst;
    int do_hash = 1;
    Py_ssize_t max_head = (1 << 20) + 4096, align = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&w*w*|pnn", names, PyUnicode_FSConverter, &path, &head, &dst,
                                     &do_hash, &max_head, &align))
        return NULL;
    PyObject *ret = NULL;
    const char *p = PyBytes_AS_STRING(path);
    int fd = -1, status = 0, err = 0, open_err = 0;
    ssize_t hgot = 0, dgot = 0;
    long long size = 0;
    uint64_t h = 0;
    if (align <= 0) align = 4096;
    Py_BEGIN_ALLOW_THREADS
    do { fd = open(p, O_RDONLY | O_CLOEXEC | O_NONBLOCK); } while (fd < 0 && errno == EINTR);
    if (fd < 0) open_err = errno;
    else {
        struct stat sb;
        if (fstat(fd, &sb) < 0) err = errno;
        else if (!S_ISREG(sb.st_mode)) status = 1;
        else {
            size = (long long)sb.st_size;
            long long guess = size - (long long)dst.len;
            if (guess < align || guess % align || guess > max_head) status = 2;
            else if (guess > (long long)head.len) status = 3;
            else err = pread_hash_core(fd, head.buf, (size_t)guess, dst.buf, (size_t)dst.len, 0, do_hash,
                                       DEFAULT_PIECE, &hgot, &dgot, &h);
        }
        close(fd);
    }
    Py_END_ALLOW_THREADS
    Py_ssize_t dlen = dst.len;
    PyBuffer_Release(&head);
    PyBuffer_Release(&dst);
    if (open_err) {
        errno = open_err;
        PyObject *name = PyUnicode_DecodeFSDefault(p);
        if (name) { PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name); Py_DECREF(name); }
    } else if (err) {
        os_error(err);
    } else if (status == 0 && do_hash && dgot == dlen) {
        ret = Py_BuildValue("iLnnK", status, size, (Py_ssize_t)hgot, (Py_ssize_t)dgot, (unsigned long long)h);
    } else {
        ret = Py_BuildValue("iLnnO", status, size, (Py_ssize_t)hgot, (Py_ssize_t)dgot, Py_None);
    }
    Py_DECREF(path);
    return ret;
}

static void put_hex(char *out, uint64_t v) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 15; i >= 0; i--) { out[i] = digits[v & 15]; v >>= 4; }
}

#define KVF_DIFFER (-1)

/* The body of pwrite_hash, GIL not held: the payload at offset + hlen piece by piece, each piece hashed just
 * before its write, then hdr (the caller's copy, patched here with both checksums) at offset. With count > 0
 * each piece is first compared, while it is in cache, with the same bytes of count other copies (others,
 * stride apart). Returns 0, an errno, or KVF_DIFFER (the header not written) at the first piece that differs. */
static int pwrite_hash_core(int fd, char *hdr, size_t hlen, const char *payload, size_t len, size_t dpos,
                            size_t hpos, off_t offset, size_t piece, const char *others, size_t stride,
                            size_t count, uint64_t *dh_out, uint64_t *hh_out) {
    kvf_xxh3_state st;
    kvf_xxh3_init(&st, payload, len);
    size_t done = 0;
    while (done < len) {
        size_t n = len - done < piece ? len - done : piece;
        for (size_t r = 0; r < count; r++)
            if (memcmp(others + r * stride + done, payload + done, n)) return KVF_DIFFER;
        kvf_xxh3_update(&st, done + n);
        struct iovec one = {(char *)payload + done, n};
        ssize_t w = write_full(fd, &one, 1, offset + (off_t)hlen + (off_t)done);
        if (w < 0) return (int)-w;
        done += n;
    }
    uint64_t dh = kvf_xxh3_digest(&st);
    put_hex(hdr + dpos, dh);
    memset(hdr + hpos, '0', 16);
    uint64_t hh = kvf_xxh3_64(hdr, hlen);
    put_hex(hdr + hpos, hh);
    struct iovec one = {hdr, hlen};
    ssize_t w = write_full(fd, &one, 1, offset);
    if (w < 0) return (int)-w;
    *dh_out = dh;
    *hh_out = hh;
    return 0;
}

PyDoc_STRVAR(pwrite_hash_doc,
"pwrite_hash(fd, header, payload, dxxh3_pos, hxxh3_pos, offset=0, piece=262144, others=None, count=0, stride=0)\n"
"    -> (dxxh3, hxxh3) or None\n\n"
"Write one kvformat file (header region then payload) at offset. The payload goes out piece by piece, each\n"
"hashed just before its write; then the payload's xxh3 is put as 16 hex digits at header[dxxh3_pos:], the\n"
"header checksum (with its own 16 digits as '0') at header[hxxh3_pos:], and the header is written. header is\n"
"not modified (a copy is patched). Returns both checksums as ints. With count > 0, others holds count more\n"
"copies of the payload, the r-th at others[r * stride:]: each piece is compared with them before it is written,\n"
"and None is returned (the header not written) at the first piece that differs.");

static PyObject *py_pwrite_hash(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "header", "payload", "dxxh3_pos", "hxxh3_pos", "offset", "piece", "others",
                            "count", "stride", NULL};
    int fd;
    Py_buffer hb, pb, ob = {0};
    Py_ssize_t dpos, hpos, piece = DEFAULT_PIECE, count = 0, stride = 0;
    long long offset = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iy*y*nn|Lnz*nn", names, &fd, &hb, &pb, &dpos, &hpos, &offset,
                                     &piece, &ob, &count, &stride))
        return NULL;
    const char *why = NULL;
    /* Written as subtractions from the length: dpos + 16 wraps for dpos near PY_SSIZE_T_MAX and would pass. The
     * overlap test adds 16 only to positions already known to be at most hb.len - 16. */
    if (hb.len < 16 || dpos < 0 || hpos < 0 || dpos > hb.len - 16 || hpos > hb.len - 16 ||
        (dpos < hpos + 16 && hpos < dpos + 16))
        why = "checksum positions outside the header or overlapping";
    /* count copies of len(payload) bytes, stride apart, inside others: by division, no product to overflow */
    else if (count < 0 || (count > 0 && (!ob.buf || stride < pb.len || stride <= 0 || ob.len < pb.len ||
                                         (ob.len - pb.len) / stride < count - 1)))
        why = "others does not hold count copies of the payload, stride apart";
    char *hdr = NULL;
    /* page-aligned: the fd may be O_DIRECT (the payload then is the caller's aligned row) */
    if (!why && posix_memalign((void **)&hdr, 4096, (size_t)hb.len)) hdr = NULL;
    if (why || !hdr) {
        PyBuffer_Release(&hb); PyBuffer_Release(&pb); PyBuffer_Release(&ob);
        if (why) PyErr_SetString(PyExc_ValueError, why);
        else PyErr_NoMemory();
        return NULL;
    }
    if (piece < 4096) piece = 4096;
    int err;
    uint64_t dh = 0, hh = 0;
    Py_BEGIN_ALLOW_THREADS
    memcpy(hdr, hb.buf, (size_t)hb.len);
    err = pwrite_hash_core(fd, hdr, (size_t)hb.len, (const char *)pb.buf, (size_t)pb.len, (size_t)dpos,
                           (size_t)hpos, (off_t)offset, (size_t)piece, (const char *)ob.buf, (size_t)stride,
                           (size_t)count, &dh, &hh);
    Py_END_ALLOW_THREADS
    free(hdr);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&pb);
    PyBuffer_Release(&ob);
    if (err == KVF_DIFFER) Py_RETURN_NONE;
    if (err) return os_error(err);
    return Py_BuildValue("KK", (unsigned long long)dh, (unsigned long long)hh);
}

/* Whether cnt pieces of nb bytes, the k-th at off + k * stride, all lie in [0, len). Every argument is
 * non-negative (checked by the caller). Never forms off + (cnt - 1) * stride + nb, which wraps for large
 * values (signed overflow: undefined, in practice a negative sum that passes): each step subtracts from
 * what is left, and the stride term is compared by division. */
static int run_fits(int64_t off, int64_t nb, int64_t cnt, int64_t stride, Py_ssize_t len) {
    if (cnt == 0) return 1;
    if (nb > (int64_t)len || off > (int64_t)len - nb) return 0;
    int64_t room = (int64_t)len - nb - off;  /* how far the last piece may start past the first */
    return cnt == 1 || stride == 0 || (cnt - 1) <= room / stride;
}

/* copy_runs(dst, src, runs): runs is int64 sextuples (src offset, dst offset, bytes, count, src stride, dst
 * stride): count pieces of bytes each, the i-th from src + src offset + i * src stride. Every piece is checked
 * against both buffers first, then all are copied with the GIL released (a DCP row's token runs are thousands
 * of small pieces: a Python loop, or numpy holding the GIL, would serialize the tier's I/O threads). */
static PyObject *py_copy_runs(PyObject *self, PyObject *args) {
    Py_buffer dst, src, runs;
    if (!PyArg_ParseTuple(args, "w*y*y*", &dst, &src, &runs)) return NULL;
    PyObject *ret = NULL;
    if (runs.len % (6 * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "runs: expected int64 sextuples");
        goto done;
    }
    const int64_t *r = (const int64_t *)runs.buf;
    Py_ssize_t n = runs.len / (6 * (Py_ssize_t)sizeof(int64_t));
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *x = r + 6 * i;
        int64_t so = x[0], po = x[1], nb = x[2], cnt = x[3], ss = x[4], ps = x[5];
        if (so < 0 || po < 0 || nb < 0 || cnt < 0 || ss < 0 || ps < 0 ||
            !run_fits(so, nb, cnt, ss, src.len) || !run_fits(po, nb, cnt, ps, dst.len)) {
            PyErr_SetString(PyExc_ValueError, "a copy run lies outside its buffer");
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *x = r + 6 * i;
        const char *s = (const char *)src.buf + x[0];
        char *d = (char *)dst.buf + x[1];
        if (x[2] == 0) continue;  /* nothing to copy, however many pieces */
        for (int64_t k = 0; k < x[3]; k++) memmove(d + k * x[5], s + k * x[4], (size_t)x[2]);
    }
    Py_END_ALLOW_THREADS
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&runs);
    return ret;
}

/* header_match: the tier's header check without parsing (spec section 11.1). A reader that has fully decoded
 * and checked a header region keeps it as a template; a later region that equals it outside the per-file
 * fields (block key, checksums, creation time) is the same header with those fields' values, provided each
 * field still holds its syntax (lowercase hex, canonical decimal) and, when verifying, the region's own
 * checksum holds. memcmp + one xxh3 of a few KiB: about a microsecond, so the GIL is kept for small regions. */
static int span_ok(const unsigned char *p, int64_t n, int64_t kind) {
    if (n <= 0) return 0;
    if (kind == 0) {  /* lowercase hex */
        for (int64_t i = 0; i < n; i++)
            if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) return 0;
        return 1;
    }
    if (n > 1 && p[0] == '0') return 0;  /* canonical decimal: no leading zero */
    for (int64_t i = 0; i < n; i++)
        if (p[i] < '0' || p[i] > '9') return 0;
    return 1;
}

static int region_match(const unsigned char *h, const unsigned char *t, Py_ssize_t len, const int64_t *sp,
                        Py_ssize_t nsp, Py_ssize_t hpos, int verify, unsigned char *scratch, uint64_t *hh) {
    int64_t pos = 0;
    for (Py_ssize_t i = 0; i < nsp; i++) {
        const int64_t *x = sp + 3 * i;
        if (memcmp(h + pos, t + pos, (size_t)(x[0] - pos))) return 1;
        if (!span_ok(h + x[0], x[1] - x[0], x[2])) return 1;
        pos = x[1];
    }
    if (memcmp(h + pos, t + pos, (size_t)(len - pos))) return 1;
    if (!verify) return 0;
    memcpy(scratch, h, (size_t)len);
    memset(scratch + hpos, '0', 16);
    *hh = kvf_xxh3_64(scratch, (size_t)len);
    char hex[16];
    put_hex(hex, *hh);
    return memcmp(hex, h + hpos, 16) ? 2 : 0;
}

PyDoc_STRVAR(header_match_doc,
"header_match(head, template, spans, hxxh3_pos, verify) -> (status, hxxh3)\n\n"
"spans: int64 triples (start, end, kind) in order, not overlapping; kind 0 = lowercase hex, 1 = canonical\n"
"decimal; one of them is the 16 digits at hxxh3_pos. status 0: head equals template outside the spans, every\n"
"span holds its kind and (verify) the header checksum holds; 1: it does not (parse it); 2: it matches but the\n"
"checksum differs (hxxh3 is the computed one, else 0).");

static PyObject *py_header_match(PyObject *self, PyObject *args) {
    Py_buffer hb, tb, sb;
    Py_ssize_t hpos;
    int verify;
    if (!PyArg_ParseTuple(args, "y*y*y*np", &hb, &tb, &sb, &hpos, &verify)) return NULL;
    PyObject *ret = NULL;
    unsigned char *scratch = NULL;
    const int64_t *sp = (const int64_t *)sb.buf;
    Py_ssize_t nsp = sb.len / (3 * (Py_ssize_t)sizeof(int64_t)), len = tb.len;
    int has_h = 0, status = 1;
    uint64_t hh = 0;
    if (sb.len % (3 * (Py_ssize_t)sizeof(int64_t))) {
        PyErr_SetString(PyExc_ValueError, "spans: expected int64 triples");
        goto done;
    }
    for (Py_ssize_t i = 0, prev = 0; i < nsp; i++) {
        const int64_t *x = sp + 3 * i;
        if (x[0] < prev || x[1] < x[0] || x[1] > len || (x[2] != 0 && x[2] != 1)) {
            PyErr_SetString(PyExc_ValueError, "spans: out of order, outside the template or of an unknown kind");
            goto done;
        }
        if (x[0] == hpos && x[1] == hpos + 16 && x[2] == 0) has_h = 1;
        prev = (Py_ssize_t)x[1];
    }
    if (!has_h) {
        PyErr_SetString(PyExc_ValueError, "hxxh3_pos: not one of the hex spans of 16 digits");
        goto done;
    }
    if (hb.len == len) {
        if (verify && !(scratch = malloc((size_t)len ? (size_t)len : 1))) { PyErr_NoMemory(); goto done; }
        if (len >= (1 << 16)) {
            Py_BEGIN_ALLOW_THREADS
            status = region_match(hb.buf, tb.buf, len, sp, nsp, hpos, verify, scratch, &hh);
            Py_END_ALLOW_THREADS
        } else {
            status = region_match(hb.buf, tb.buf, len, sp, nsp, hpos, verify, scratch, &hh);
        }
    }
    ret = Py_BuildValue("iK", status, (unsigned long long)(status == 2 ? hh : 0));
done:
    free(scratch);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&sb);
    return ret;
}

static PyMethodDef methods[] = {
    {"copy_runs", py_copy_runs, METH_VARARGS,
     "copy_runs(dst, src, runs): copy int64 (src off, dst off, bytes, count, src stride, dst stride) runs, GIL "
     "released; ValueError if a piece lies outside a buffer."},
    {"xxh3_64", py_xxh3_64, METH_O, "xxh3_64(buffer) -> int: XXH3-64, seed 0, default secret."},
    {"simd", py_simd, METH_NOARGS, "simd() -> 'avx512', 'avx2' or 'scalar': the accumulate kernel in use."},
    {"set_simd", py_set_simd, METH_O, "set_simd('auto'|'scalar'|'avx2'|'avx512') -> the previous kernel's name."},
    {"have_avx2", py_have_avx2, METH_NOARGS, "have_avx2() -> whether this CPU runs the AVX2 kernel."},
    {"have_avx512", py_have_avx512, METH_NOARGS, "have_avx512() -> whether this CPU (and OS) runs the AVX-512 kernel."},
    {"pread_hash", (PyCFunction)(void (*)(void))py_pread_hash, METH_VARARGS | METH_KEYWORDS, pread_hash_doc},
    {"pwrite_hash", (PyCFunction)(void (*)(void))py_pwrite_hash, METH_VARARGS | METH_KEYWORDS, pwrite_hash_doc},
    {"header_match", py_header_match, METH_VARARGS, header_match_doc},
    {"read_file_hash", (PyCFunction)(void (*)(void))py_read_file_hash, METH_VARARGS | METH_KEYWORDS,
     read_file_hash_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvfnative",
    "Native xxh3-64 and fused read/write + hash for kvformat (see kvformat._native).", -1, methods};

PyMODINIT_FUNC PyInit__kvfnative(void) {
    kvf_xxh3_select(-1);
    return PyModule_Create(&module);
}
