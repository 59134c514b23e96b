/* The library's CPU hashes in C, defined in Python by the modules that use them:
 *
 *   raw_sums(pages, mults, out, index)   `checksum.raw_sums`: the pages' multilinear sums,
 *                                        the pages gathered by index
 *   raw_sums_blocks(blocks, out, index, first)  `checksum.raw_sums_blocks`: raw_sums of
 *                                        several blocks of rows in one call
 *   finalise(raw, salts)                 `checksum.finalise`: raw ^= its row's salt, then
 *                                        splitmix64's finaliser
 *   prefix_hashes(tokens, mults, parent, out)  `keys.prefix_hashes`
 *   store(table, rows, cols, sums)       `checksum.store`: sums into a table of stored ones
 *   mismatched(table, rows, cols, sums)  `checksum.mismatched`: whether any differs from it
 *
 * All are exact integer arithmetic mod 2**64 and give the numpy definitions' bits
 * (tests/test_hashes_native.py). They exist for the many small calls of the cpu
 * backend's restore checks, where numpy's fixed cost per call is the cost: one call
 * here does what takes numpy five to ten. Arguments come through the buffer protocol;
 * the Python wrappers check dtypes and shapes, this module re-checks sizes and bounds.
 * raw_sums releases the GIL while it hashes more than a few pages (a copy worker's
 * large copies); the others run on the thread that checks, on small inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RELEASE_GIL_BYTES (64 * 1024)

static int get(PyObject *obj, Py_buffer *view, int flags, const char *name) {
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: not a buffer of the required kind", name);
        return -1;
    }
    return 0;
}

static inline uint64_t page_sum(const unsigned char *page, Py_ssize_t words32, const uint64_t *m) {
    /* sum_i m[i] * w_i mod 2**64 over the page's little-endian 32-bit words; two
     * accumulators keep two multiplies in flight. */
    uint64_t a0 = 0, a1 = 0;
    Py_ssize_t i = 0;
    for (; i + 1 < words32; i += 2) {
        uint32_t w0, w1;
        memcpy(&w0, page + 4 * i, 4);
        memcpy(&w1, page + 4 * i + 4, 4);
        a0 += m[i] * (uint64_t)w0;
        a1 += m[i + 1] * (uint64_t)w1;
    }
    if (i < words32) {
        uint32_t w;
        memcpy(&w, page + 4 * i, 4);
        a0 += m[i] * (uint64_t)w;
    }
    return a0 + a1;
}

/* raw_sums(pages, mults, out, index) -> None
 *
 * pages: uint8, 2-D [n, page_bytes] or 3-D [rows, n, page_bytes], last axis contiguous.
 * mults: uint64 [>= page_bytes / 4], C-contiguous (M_i over the 32-bit words).
 * out:   uint64, C-contiguous, writable, [rows * m] elements (rows = 1 for 2-D pages).
 * index: None (m = n: every page) or int64 [m], C-contiguous: the pages to hash, each in [0, n).
 */
static PyObject *raw_sums(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "raw_sums(pages, mults, out, index) takes 4 arguments");
        return NULL;
    }
    Py_buffer pv, mv, ov, iv;
    int have_index = args[3] != Py_None;
    if (get(args[0], &pv, PyBUF_STRIDES, "pages") < 0) return NULL;
    if (get(args[1], &mv, PyBUF_C_CONTIGUOUS, "mults") < 0) goto fail_p;
    if (get(args[2], &ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, "out") < 0) goto fail_m;
    if (have_index && get(args[3], &iv, PyBUF_C_CONTIGUOUS, "index") < 0) goto fail_o;

    Py_ssize_t rows, n, page_bytes, row_stride, page_stride;
    if (pv.itemsize != 1 || (pv.ndim != 2 && pv.ndim != 3)) {
        PyErr_SetString(PyExc_ValueError, "pages must be uint8 [n, page_bytes] or [rows, n, page_bytes]");
        goto fail;
    }
    page_bytes = pv.shape[pv.ndim - 1];
    n = pv.shape[pv.ndim - 2];
    rows = pv.ndim == 3 ? pv.shape[0] : 1;
    page_stride = pv.strides[pv.ndim - 2];
    row_stride = pv.ndim == 3 ? pv.strides[0] : 0;
    if (pv.strides[pv.ndim - 1] != 1 || page_bytes % 8) {
        PyErr_SetString(PyExc_ValueError, "pages: the last axis must be contiguous bytes, a multiple of 8");
        goto fail;
    }
    Py_ssize_t words32 = page_bytes / 4;
    if (mv.len < words32 * 8) {
        PyErr_SetString(PyExc_ValueError, "mults: fewer than page_bytes / 4 multipliers");
        goto fail;
    }
    Py_ssize_t m = have_index ? iv.len / 8 : n;
    if (ov.len != rows * m * 8) {
        PyErr_SetString(PyExc_ValueError, "out: not rows x pages uint64");
        goto fail;
    }
    const int64_t *index = have_index ? (const int64_t *)iv.buf : NULL;
    if (index) {
        for (Py_ssize_t j = 0; j < m; j++) {
            if (index[j] < 0 || index[j] >= n) {
                PyErr_Format(PyExc_IndexError, "index: page %lld of %zd pages", (long long)index[j], n);
                goto fail;
            }
        }
    }
    const unsigned char *base = (const unsigned char *)pv.buf;
    const uint64_t *mults = (const uint64_t *)mv.buf;
    uint64_t *out = (uint64_t *)ov.buf;
    int release = rows * m * page_bytes >= RELEASE_GIL_BYTES;
    PyThreadState *ts = release ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const unsigned char *row = base + r * row_stride;
        for (Py_ssize_t j = 0; j < m; j++) {
            Py_ssize_t page = index ? (Py_ssize_t)index[j] : j;
            out[r * m + j] = page_sum(row + page * page_stride, words32, mults);
        }
    }
    if (release) PyEval_RestoreThread(ts);
    if (have_index) PyBuffer_Release(&iv);
    PyBuffer_Release(&ov);
    PyBuffer_Release(&mv);
    PyBuffer_Release(&pv);
    Py_RETURN_NONE;

fail:
    if (have_index) PyBuffer_Release(&iv);
fail_o:
    PyBuffer_Release(&ov);
fail_m:
    PyBuffer_Release(&mv);
fail_p:
    PyBuffer_Release(&pv);
    return NULL;
}

/* raw_sums_blocks(blocks, out, index, first) -> None
 *
 * blocks: a tuple of (pages, mults, row): pages uint8 [k, N, page_bytes] (last axis
 * contiguous), mults its `mults` as in raw_sums, row the first row of `out` it fills.
 * out: uint64 [R, m], C-contiguous, writable. index: None (the pages first .. first + m - 1)
 * or int64 [m] page ids. Row row + r of `out` gets the sums of the pages of pages[r].
 */
static PyObject *raw_sums_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "raw_sums_blocks(blocks: tuple, out, index, first) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t first = PyLong_AsSsize_t(args[3]);
    if (first == -1 && PyErr_Occurred()) return NULL;
    Py_buffer ov, iv;
    int have_index = args[2] != Py_None;
    if (get(args[1], &ov, PyBUF_ND | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, "out") < 0) return NULL;
    if (have_index && get(args[2], &iv, PyBUF_C_CONTIGUOUS, "index") < 0) {
        PyBuffer_Release(&ov);
        return NULL;
    }
    const int64_t *index = have_index ? (const int64_t *)iv.buf : NULL;
    Py_ssize_t rows_out = ov.ndim == 2 ? ov.shape[0] : 0, m = ov.ndim == 2 ? ov.shape[1] : 0;
    if (ov.ndim != 2 || ov.itemsize != 8 || (have_index && iv.len != m * 8)) {
        PyErr_SetString(PyExc_ValueError, "out: not uint64 [rows, pages] (index: one id a column)");
        goto done;
    }
    uint64_t *out = (uint64_t *)ov.buf;
    for (Py_ssize_t b = 0; b < PyTuple_GET_SIZE(args[0]); b++) {
        PyObject *block = PyTuple_GET_ITEM(args[0], b);
        if (!PyTuple_Check(block) || PyTuple_GET_SIZE(block) != 3) {
            PyErr_SetString(PyExc_TypeError, "a block is (pages, mults, row)");
            goto done;
        }
        Py_ssize_t row = PyLong_AsSsize_t(PyTuple_GET_ITEM(block, 2));
        if (row == -1 && PyErr_Occurred()) goto done;
        Py_buffer pv, mv;
        if (get(PyTuple_GET_ITEM(block, 0), &pv, PyBUF_STRIDES, "pages") < 0) goto done;
        if (get(PyTuple_GET_ITEM(block, 1), &mv, PyBUF_C_CONTIGUOUS, "mults") < 0) {
            PyBuffer_Release(&pv);
            goto done;
        }
        int ok = pv.ndim == 3 && pv.itemsize == 1 && pv.strides[2] == 1 && pv.shape[2] % 8 == 0;
        Py_ssize_t k = ok ? pv.shape[0] : 0, n = ok ? pv.shape[1] : 0, words32 = ok ? pv.shape[2] / 4 : 0;
        if (!ok || mv.len < words32 * 8 || row < 0 || row + k > rows_out) {
            PyErr_Format(PyExc_ValueError, "block %zd: not uint8 [k, N, page_bytes] for rows %zd.. of %zd", b, row,
                         rows_out);
        } else {
            for (Py_ssize_t j = 0; j < m && !PyErr_Occurred(); j++) {
                Py_ssize_t page = index ? (Py_ssize_t)index[j] : first + j;
                if (page < 0 || page >= n)
                    PyErr_Format(PyExc_IndexError, "block %zd: page %zd of %zd pages", b, page, n);
            }
            const unsigned char *base = (const unsigned char *)pv.buf;
            for (Py_ssize_t r = 0; r < k && !PyErr_Occurred(); r++) {
                const unsigned char *slab = base + r * pv.strides[0];
                uint64_t *dst = out + (row + r) * m;
                for (Py_ssize_t j = 0; j < m; j++) {
                    Py_ssize_t page = index ? (Py_ssize_t)index[j] : first + j;
                    dst[j] = page_sum(slab + page * pv.strides[1], words32, (const uint64_t *)mv.buf);
                }
            }
        }
        PyBuffer_Release(&mv);
        PyBuffer_Release(&pv);
        if (PyErr_Occurred()) goto done;
    }
done:
    if (have_index) PyBuffer_Release(&iv);
    PyBuffer_Release(&ov);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static inline uint64_t fmix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

/* finalise(raw, salts) -> None: raw (uint64 [rows, n], C-contiguous, writable) becomes
 * fmix64(raw ^ salts[row]) in place; salts: uint64 [rows], C-contiguous. */
static PyObject *finalise(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "finalise(raw, salts) takes 2 arguments");
        return NULL;
    }
    Py_buffer rv, sv;
    if (get(args[0], &rv, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, "raw") < 0) return NULL;
    if (get(args[1], &sv, PyBUF_C_CONTIGUOUS, "salts") < 0) {
        PyBuffer_Release(&rv);
        return NULL;
    }
    Py_ssize_t rows = sv.len / 8;
    if (rows == 0 ? rv.len != 0 : rv.len % (rows * 8)) {
        PyErr_SetString(PyExc_ValueError, "raw: not salts-many rows of uint64");
        PyBuffer_Release(&sv);
        PyBuffer_Release(&rv);
        return NULL;
    }
    Py_ssize_t n = rows ? rv.len / (rows * 8) : 0;
    uint64_t *raw = (uint64_t *)rv.buf;
    const uint64_t *salts = (const uint64_t *)sv.buf;
    for (Py_ssize_t r = 0; r < rows; r++)
        for (Py_ssize_t j = 0; j < n; j++) raw[r * n + j] = fmix64(raw[r * n + j] ^ salts[r]);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&rv);
    Py_RETURN_NONE;
}

/* prefix_hashes(tokens, mults, parent, out) -> None
 *
 * tokens: int64 [n * page_size], C-contiguous; mults: uint64 [page_size] (the odd multiplier
 * of each position in a page); parent: the chain's hash before the first page (int, 0 for
 * none); out: uint64 [n], C-contiguous, writable. With g_i = fmix64((sum_t mults[t] *
 * token_t) ^ page_size) over page i's tokens, out[i] = x_i = x_{i-1} * P + g_i, x_-1 = parent.
 */
static PyObject *prefix_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "prefix_hashes(tokens, mults, parent, out) takes 4 arguments");
        return NULL;
    }
    uint64_t parent = PyLong_AsUnsignedLongLongMask(args[2]);
    if (parent == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    Py_buffer tv, mv, ov;
    if (get(args[0], &tv, PyBUF_C_CONTIGUOUS, "tokens") < 0) return NULL;
    if (get(args[1], &mv, PyBUF_C_CONTIGUOUS, "mults") < 0) {
        PyBuffer_Release(&tv);
        return NULL;
    }
    if (get(args[3], &ov, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, "out") < 0) {
        PyBuffer_Release(&mv);
        PyBuffer_Release(&tv);
        return NULL;
    }
    Py_ssize_t page_size = mv.len / 8, n = ov.len / 8;
    if (page_size == 0 || tv.len != n * page_size * 8) {
        PyErr_SetString(PyExc_ValueError, "tokens: not out-many pages of mults-many int64 tokens");
    } else {
        const uint64_t *tok = (const uint64_t *)tv.buf, *m = (const uint64_t *)mv.buf;
        uint64_t *out = (uint64_t *)ov.buf, x = parent;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t sum = 0;
            for (Py_ssize_t t = 0; t < page_size; t++) sum += m[t] * tok[i * page_size + t];
            x = x * 0x9E3779B97F4A7C15ULL + fmix64(sum ^ (uint64_t)page_size);
            out[i] = x;
        }
    }
    PyBuffer_Release(&ov);
    PyBuffer_Release(&mv);
    PyBuffer_Release(&tv);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* The table cells of store and mismatched: row i of `sums` (uint64 [len(rows), n],
 * C-contiguous) against table[rows[i], cols[j]] (table: uint64 [R, C], C-contiguous;
 * rows: None for every table row in order, else int64 [m]; cols: int64 [n]). */
typedef struct {
    Py_buffer tv, rv, cv, sv;
    int have_rows;
    Py_ssize_t m, n, width;
} Cells;

static void cells_release(Cells *c) {
    PyBuffer_Release(&c->sv);
    PyBuffer_Release(&c->cv);
    if (c->have_rows) PyBuffer_Release(&c->rv);
    PyBuffer_Release(&c->tv);
}

static int cells_get(PyObject *const *args, Py_ssize_t nargs, int writable, Cells *c) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "takes (table, rows, cols, sums)");
        return -1;
    }
    c->have_rows = args[1] != Py_None;
    if (get(args[0], &c->tv, PyBUF_ND | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0), "table") < 0)
        return -1;
    if (c->have_rows && get(args[1], &c->rv, PyBUF_C_CONTIGUOUS, "rows") < 0) {
        PyBuffer_Release(&c->tv);
        return -1;
    }
    if (get(args[2], &c->cv, PyBUF_C_CONTIGUOUS, "cols") < 0) {
        if (c->have_rows) PyBuffer_Release(&c->rv);
        PyBuffer_Release(&c->tv);
        return -1;
    }
    if (get(args[3], &c->sv, PyBUF_C_CONTIGUOUS, "sums") < 0) {
        PyBuffer_Release(&c->cv);
        if (c->have_rows) PyBuffer_Release(&c->rv);
        PyBuffer_Release(&c->tv);
        return -1;
    }
    if (c->tv.ndim != 2 || c->tv.itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "table: not a 2-D table of uint64");
        goto fail;
    }
    Py_ssize_t height = c->tv.shape[0];
    c->width = c->tv.shape[1];
    c->n = c->cv.len / 8;
    c->m = c->have_rows ? c->rv.len / 8 : height;
    if (c->sv.len != c->m * c->n * 8) {
        PyErr_SetString(PyExc_ValueError, "sums: not rows x cols uint64");
        goto fail;
    }
    const int64_t *rows = c->have_rows ? (const int64_t *)c->rv.buf : NULL, *cols = (const int64_t *)c->cv.buf;
    for (Py_ssize_t i = 0; rows && i < c->m; i++) {
        if (rows[i] < 0 || rows[i] >= height) {
            PyErr_Format(PyExc_IndexError, "rows: row %lld of %zd", (long long)rows[i], height);
            goto fail;
        }
    }
    for (Py_ssize_t j = 0; j < c->n; j++) {
        if (cols[j] < 0 || cols[j] >= c->width) {
            PyErr_Format(PyExc_IndexError, "cols: page %lld of %zd", (long long)cols[j], c->width);
            goto fail;
        }
    }
    return 0;
fail:
    cells_release(c);
    return -1;
}

/* store(table, rows, cols, sums) -> None: table[rows[i], cols[j]] = sums[i, j]. */
static PyObject *store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Cells c;
    if (cells_get(args, nargs, 1, &c) < 0) return NULL;
    uint64_t *table = (uint64_t *)c.tv.buf;
    const uint64_t *sums = (const uint64_t *)c.sv.buf;
    const int64_t *rows = c.have_rows ? (const int64_t *)c.rv.buf : NULL, *cols = (const int64_t *)c.cv.buf;
    for (Py_ssize_t i = 0; i < c.m; i++) {
        uint64_t *row = table + (rows ? rows[i] : i) * c.width;
        for (Py_ssize_t j = 0; j < c.n; j++) row[cols[j]] = sums[i * c.n + j];
    }
    cells_release(&c);
    Py_RETURN_NONE;
}

/* mismatched(table, rows, cols, sums) -> bool: whether any sums[i, j] != table[rows[i], cols[j]]. */
static PyObject *mismatched(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Cells c;
    if (cells_get(args, nargs, 0, &c) < 0) return NULL;
    const uint64_t *table = (const uint64_t *)c.tv.buf, *sums = (const uint64_t *)c.sv.buf;
    const int64_t *rows = c.have_rows ? (const int64_t *)c.rv.buf : NULL, *cols = (const int64_t *)c.cv.buf;
    uint64_t differ = 0;
    for (Py_ssize_t i = 0; i < c.m; i++) {
        const uint64_t *row = table + (rows ? rows[i] : i) * c.width;
        for (Py_ssize_t j = 0; j < c.n; j++) differ |= row[cols[j]] ^ sums[i * c.n + j];
    }
    cells_release(&c);
    return PyBool_FromLong(differ != 0);
}

static PyMethodDef methods[] = {
    {"raw_sums", (PyCFunction)(void (*)(void))raw_sums, METH_FASTCALL,
     "raw_sums(pages, mults, out, index): the pages' multilinear sums into out"},
    {"raw_sums_blocks", (PyCFunction)(void (*)(void))raw_sums_blocks, METH_FASTCALL,
     "raw_sums_blocks(blocks, out, index, first): raw_sums of several blocks of rows into out"},
    {"finalise", (PyCFunction)(void (*)(void))finalise, METH_FASTCALL,
     "finalise(raw, salts): raw = fmix64(raw ^ salts[row]) in place"},
    {"prefix_hashes", (PyCFunction)(void (*)(void))prefix_hashes, METH_FASTCALL,
     "prefix_hashes(tokens, mults, parent, out): the pages' prefix hashes into out"},
    {"store", (PyCFunction)(void (*)(void))store, METH_FASTCALL,
     "store(table, rows, cols, sums): table[rows[i], cols[j]] = sums[i, j]"},
    {"mismatched", (PyCFunction)(void (*)(void))mismatched, METH_FASTCALL,
     "mismatched(table, rows, cols, sums): whether any sums[i, j] != table[rows[i], cols[j]]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hicache_cp._hashes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hashes(void) { return PyModule_Create(&module); }
