/* The float32 casts of actstore.casts, so the writers that store 16-bit values (zarr, lmprobe with
 * dtype float16 or bfloat16) need neither numpy's float16 cast, which converts one value at a time
 * (~15x slower), nor torch, whose import costs a writer job seconds and ~150 MB.
 *
 * float16, with the CPU's F16C instructions: they round to nearest even, as numpy does; the two
 * differ only in NaN payloads (F16C quiets a signalling NaN and truncates its payload), so the cast
 * returns how many outputs have an all-ones exponent (inf or NaN) and the caller redoes those few
 * with numpy. bfloat16, as torch rounds it: to nearest even, every NaN 0xFFFF (a loop the compiler
 * vectorises). x86 only, and the import fails on a CPU without F16C: actstore then casts with
 * numpy, which gives the same bits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#if !defined(__x86_64__) && !defined(__i386__)
#error "F16C is an x86 extension; elsewhere actstore casts with numpy"
#endif
#include <immintrin.h>

#define F16_EXPONENT 0x7C00

/* dst[i] = float16(src[i]) for i < n; returns the count of outputs that are inf or NaN. */
__attribute__((target("avx,f16c,popcnt")))
static Py_ssize_t cast(const float *src, uint16_t *dst, Py_ssize_t n) {
    const __m128i exponent = _mm_set1_epi16(F16_EXPONENT);
    Py_ssize_t i = 0, special_bytes = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(dst + i), h);
        __m128i all_ones = _mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent);
        special_bytes += _mm_popcnt_u32((unsigned)_mm_movemask_epi8(all_ones));  /* 2 bits per value */
    }
    Py_ssize_t special = special_bytes / 2;
    for (; i < n; i++) {
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
        special += (dst[i] & F16_EXPONENT) == F16_EXPONENT;
    }
    return special;
}

/* dst[i] = bfloat16 bits of src[i] (as uint32 bits), i < n. */
static void cast_bf16(const uint32_t *src, uint16_t *dst, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t u = src[i];
        uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
        dst[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0xFFFF : rounded;
    }
}

static PyObject *f32_to_bf16(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*:f32_to_bf16", &src, &dst))
        return NULL;
    int ok = src.len % 4 == 0 && dst.len * 2 == src.len;
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "f32_to_bf16: %zd float32 bytes into %zd bfloat16 bytes", src.len, dst.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        cast_bf16((const uint32_t *)src.buf, (uint16_t *)dst.buf, src.len / 4);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *f32_to_f16(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "y*w*:f32_to_f16", &src, &dst))
        return NULL;
    Py_ssize_t special = -1;
    if (src.len % 4 != 0 || dst.len * 2 != src.len) {
        PyErr_Format(PyExc_ValueError, "f32_to_f16: %zd float32 bytes into %zd float16 bytes", src.len, dst.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        special = cast((const float *)src.buf, (uint16_t *)dst.buf, src.len / 4);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return special < 0 ? NULL : PyLong_FromSsize_t(special);
}

static PyMethodDef methods[] = {
    {"f32_to_f16", f32_to_f16, METH_VARARGS,
     "f32_to_f16(src, dst) -> int: float32 buffer src cast into float16 buffer dst (round to nearest even, "
     "no GIL); returns how many outputs are inf or NaN."},
    {"f32_to_bf16", f32_to_bf16, METH_VARARGS,
     "f32_to_bf16(src, dst) -> None: float32 buffer src as bfloat16 bits into dst (round to nearest even, "
     "every NaN 0xFFFF, as torch casts; no GIL)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_casts", NULL, -1, methods};

PyMODINIT_FUNC PyInit__casts(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("f16c") || !__builtin_cpu_supports("avx") || !__builtin_cpu_supports("popcnt")) {
        PyErr_SetString(PyExc_ImportError, "actstore._casts: this CPU has no F16C");
        return NULL;
    }
    return PyModule_Create(&module);
}
