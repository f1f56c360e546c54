/* Row scatter with non-temporal stores, for the saev shuffled loader (actstore.saev_loader).
 *
 * The loader copies each activation vector to a random row of a shuffle buffer far larger than the
 * cache. With ordinary stores the CPU first reads every destination cache line it is about to
 * overwrite; streaming stores skip that read, which made the scatter 2.7x faster on the dev machine
 * (bench/README.md `## saev`). numpy has no way to ask for them, hence this file. Optional at build
 * time: without it the loader falls back to numpy's fancy assignment, with identical results.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
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

PyDoc_STRVAR(scatter_doc,
"scatter(dst, dst_rows, dst_row_bytes, src, n_ex, n_layers, n_tok, ex_stride, layer_stride, tok_stride,\n"
"        nbytes, rows)\n"
"\n"
"For every (e, t) < (n_ex, n_tok), fill row rows[e*n_tok + t] of dst: its n_layers chunks of nbytes,\n"
"chunk l from src + e*ex_stride + l*layer_stride + t*tok_stride. Addresses are integers (numpy's\n"
".ctypes.data); rows is int64, each in [0, dst_rows). Runs without the GIL.");

static PyObject *scatter(PyObject *self, PyObject *args) {
    unsigned long long dst, src, rows_addr;
    Py_ssize_t dst_rows, dst_row_bytes, n_ex, n_layers, n_tok, ex_stride, layer_stride, tok_stride, nbytes;
    if (!PyArg_ParseTuple(args, "KnnKnnnnnnnK", &dst, &dst_rows, &dst_row_bytes, &src, &n_ex, &n_layers, &n_tok,
                          &ex_stride, &layer_stride, &tok_stride, &nbytes, &rows_addr))
        return NULL;
    if (nbytes < 0 || n_layers < 0 || n_layers * nbytes > dst_row_bytes || n_ex < 0 || n_tok < 0) {
        PyErr_Format(PyExc_ValueError, "scatter: %zd chunks of %zd bytes do not fit a %zd-byte row", n_layers,
                     nbytes, dst_row_bytes);
        return NULL;
    }
    const int64_t *rows = (const int64_t *)(uintptr_t)rows_addr;
    Py_ssize_t n = n_ex * n_tok, bad = -1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= dst_rows) {
            bad = i;
            break;
        }
    }
    if (bad < 0) {
        for (Py_ssize_t e = 0; e < n_ex; e++) {
            for (Py_ssize_t t = 0; t < n_tok; t++) {
                char *row = (char *)(uintptr_t)dst + rows[e * n_tok + t] * dst_row_bytes;
                const char *from = (const char *)(uintptr_t)src + e * ex_stride + t * tok_stride;
                for (Py_ssize_t l = 0; l < n_layers; l++)
                    copy_streaming(row + l * nbytes, from + l * layer_stride, (size_t)nbytes);
            }
        }
#ifdef __SSE2__
        _mm_sfence(); /* streaming stores are weakly ordered: make them visible before returning */
#endif
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "scatter: rows[%zd] = %lld is outside [0, %zd)", bad, (long long)rows[bad],
                     dst_rows);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scatter", scatter, METH_VARARGS, scatter_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scatter", "Row scatter with streaming stores.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__scatter(void) { return PyModule_Create(&module); }
