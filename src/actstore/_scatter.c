/* Block reads + row scatter with non-temporal stores, for the saev shuffled loader (actstore.formats.saev.loader).
 *
 * The loader reads many small blocks (a few tokens of one example) and copies each activation vector
 * to a random row of a shuffle buffer far larger than the cache. Both halves live here so one call
 * handles thousands of blocks without the GIL and without a Python step per block: each block is
 * pread into a small scratch buffer that stays in cache, then scattered. With ordinary stores the CPU
 * first reads every destination cache line it is about to overwrite; streaming stores skip that read,
 * which made the scatter 2.7x faster on the dev machine (bench/README.md `## saev`). Optional at build
 * time: without it the loader reads and scatters with numpy, with identical results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

static void copy_streaming(char *dst, const char *src, size_t nbytes) {
#ifdef __SSE2__
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > nbytes)
        head = nbytes;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    nbytes -= head;
    size_t body = nbytes & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + body, src + body, nbytes - body);
#else
    memcpy(dst, src, nbytes);
#endif
}

/* pread exactly n bytes at offset: 0, 1 when the file ends first (*ended: where), -1 with errno set.
 * (Returning where it ended in place of 1 made a file that ends at offset 0 look read.) */
static int pread_all(int fd, char *dst, size_t n, long long offset, long long *ended) {
    size_t done = 0;
    while (done < n) {
        ssize_t got = pread(fd, dst + done, n - done, (off_t)(offset + (long long)done));
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (got == 0) {
            *ended = offset + (long long)done;
            return 1;
        }
        done += (size_t)got;
    }
    return 0;
}

PyDoc_STRVAR(fill_doc,
"fill(dst, dst_rows, dst_row_bytes, scratch, scratch_bytes, n_blocks, fds, offsets, n_ex, n_tok, ex_stride,\n"
"     n_layers, layer_offsets, vec_bytes, rows) -> None or (block, offset, errno)\n"
"\n"
"For each block i: read its n_ex[i] examples x n_layers layers x n_tok[i] tokens of vec_bytes from file\n"
"fds[i] (example e, layer l at offsets[i] + e*ex_stride + layer_offsets[l]; reads that follow each other\n"
"in the file are merged) into scratch, then copy each token's n_layers vectors to row\n"
"rows[k] of dst (k counts (block, example, token) in order; rows[k] < 0: not kept) with streaming\n"
"stores. Addresses are integers (numpy's .ctypes.data); arrays are int64. Runs without the GIL.\n"
"Returns None, or (block, offset, errno) when block's read at offset failed: errno 0 when its file\n"
"ended there (truncated shard), else the read's error.");

static PyObject *fill(PyObject *self, PyObject *args) {
    unsigned long long dst, scratch, fds_a, offsets_a, n_ex_a, n_tok_a, layer_a, rows_a;
    Py_ssize_t dst_rows, dst_row_bytes, scratch_bytes, n_blocks, ex_stride, n_layers, vec_bytes;
    if (!PyArg_ParseTuple(args, "KnnKnnKKKKnnKnK", &dst, &dst_rows, &dst_row_bytes, &scratch, &scratch_bytes,
                          &n_blocks, &fds_a, &offsets_a, &n_ex_a, &n_tok_a, &ex_stride, &n_layers, &layer_a,
                          &vec_bytes, &rows_a))
        return NULL;
    const int64_t *fds = (const int64_t *)(uintptr_t)fds_a, *offsets = (const int64_t *)(uintptr_t)offsets_a;
    const int64_t *n_ex = (const int64_t *)(uintptr_t)n_ex_a, *n_tok = (const int64_t *)(uintptr_t)n_tok_a;
    const int64_t *layer_off = (const int64_t *)(uintptr_t)layer_a, *rows = (const int64_t *)(uintptr_t)rows_a;
    if (vec_bytes <= 0 || n_layers <= 0 || n_layers > dst_row_bytes / vec_bytes) {  /* divided: no overflow */
        PyErr_Format(PyExc_ValueError, "fill: %zd vectors of %zd bytes do not fit a %zd-byte row", n_layers,
                     vec_bytes, dst_row_bytes);
        return NULL;
    }
    Py_ssize_t bad = -1, k = 0;
    long long end = 0, offset_failed = 0;
    int read = 0, err = 0;
    const char *why = NULL;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n_blocks && bad < 0; i++) {
        Py_ssize_t ne = n_ex[i], nt = n_tok[i];
        /* divided, so that no product of the caller's sizes can overflow past the check */
        if (ne < 0 || nt < 0 || (nt > 0 && (nt > scratch_bytes / vec_bytes || ne > scratch_bytes / n_layers / (nt * vec_bytes)))) {
            why = "block larger than scratch";
            bad = i;
            break;
        }
        if (ne == 0 || nt == 0)
            continue; /* nothing to read and no row to fill (k moves by ne * nt) */
        Py_ssize_t run = nt * vec_bytes;
        /* Reads: (e, l) in scratch order; one pread per run of reads contiguous in file and scratch. */
        char *s = (char *)(uintptr_t)scratch, *pend = s;
        long long pend_off = 0;
        size_t pend_len = 0;
        for (Py_ssize_t r = 0; r <= ne * n_layers && bad < 0; r++) {
            long long off = r < ne * n_layers ? offsets[i] + (r / n_layers) * ex_stride + layer_off[r % n_layers] : -1;
            char *to = s + r * run;
            if (r < ne * n_layers && pend_len && off == pend_off + (long long)pend_len && to == pend + pend_len) {
                pend_len += (size_t)run;
                continue;
            }
            if (pend_len) {
                read = pread_all((int)fds[i], pend, pend_len, pend_off, &end);
                if (read != 0) {
                    err = read < 0 ? errno : 0;
                    offset_failed = pend_off;
                    bad = i;
                }
            }
            pend = to;
            pend_off = off;
            pend_len = (size_t)run;
        }
        if (bad >= 0)
            break;
        for (Py_ssize_t e = 0; e < ne; e++) {
            for (Py_ssize_t t = 0; t < nt; t++, k++) {
                int64_t row = rows[k];
                if (row < 0)
                    continue;
                if (row >= dst_rows) {
                    why = "row outside dst";
                    bad = i;
                    break;
                }
                char *to = (char *)(uintptr_t)dst + row * dst_row_bytes;
                const char *from = s + (e * n_layers * nt + t) * vec_bytes;
                for (Py_ssize_t l = 0; l < n_layers; l++)
                    copy_streaming(to + l * vec_bytes, from + l * run, (size_t)vec_bytes);
            }
            if (bad >= 0)
                break;
        }
    }
#ifdef __SSE2__
    _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
#endif
    Py_END_ALLOW_THREADS
    if (bad < 0)
        Py_RETURN_NONE;
    if (why != NULL) {
        PyErr_Format(PyExc_ValueError, "fill: block %zd: %s", bad, why);
        return NULL;
    }
    return Py_BuildValue("(nLi)", bad, read < 0 ? offset_failed : end, read < 0 ? err : 0);
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS, fill_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scatter", "Block reads + row scatter with streaming stores.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__scatter(void) { return PyModule_Create(&module); }
