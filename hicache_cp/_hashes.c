/* The library's CPU hashes in C, defined in Python by the modules that use them:
 *
 *   raw_sums(pages, mults, out, index)   `checksum.raw_sums`: the pages' multilinear sums,
 *                                        the pages gathered by index
 *   finalise(raw, salts)                 `checksum.finalise`: raw ^= its row's salt, then
 *                                        splitmix64's finaliser
 *   prefix_hashes(tokens, mults, parent, out)  `keys.prefix_hashes`
 *
 * All are exact integer arithmetic mod 2**64 and give the numpy definitions' bits
 * (tests/test_hashes_native.py). They exist for the many small calls of the cpu
 * backend's restore checks, where numpy's fixed cost per call is the cost: one call
 * here does what takes numpy five to ten. Arguments come through the buffer protocol;
 * the Python wrappers check dtypes and shapes, this module re-checks sizes. The GIL
 * is released while a call hashes more than a few pages.
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

static PyMethodDef methods[] = {
    {"raw_sums", (PyCFunction)(void (*)(void))raw_sums, METH_FASTCALL,
     "raw_sums(pages, mults, out, index): the pages' multilinear sums into out"},
    {"finalise", (PyCFunction)(void (*)(void))finalise, METH_FASTCALL,
     "finalise(raw, salts): raw = fmix64(raw ^ salts[row]) in place"},
    {"prefix_hashes", (PyCFunction)(void (*)(void))prefix_hashes, METH_FASTCALL,
     "prefix_hashes(tokens, mults, parent, out): the pages' prefix hashes into out"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hicache_cp._hashes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hashes(void) { return PyModule_Create(&module); }
