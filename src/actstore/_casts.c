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
 *
 * f16_file: a zarr shard's chunk file in one call without the GIL (read the rows, cast them, make
 * the directories, write the file with a hole for its padding), so that a job's threads, each writing
 * its own files, do not queue for the GIL after every system call (casts.float16_file).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
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

/* pread exactly n bytes at offset: 0, 1 when the file ends first, -1 with errno set. */
static int pread_all(int fd, char *dst, size_t n, off_t offset) {
    for (size_t done = 0; done < n;) {
        ssize_t got = pread(fd, dst + done, n - done, offset + (off_t)done);
        if (got < 0 && errno != EINTR)
            return -1;
        if (got == 0)
            return 1;
        done += got > 0 ? (size_t)got : 0;
    }
    return 0;
}

/* A new file at path of `size` bytes: src's first `written`, then a hole (zeros read back); the disk
 * started on it (Linux). 0, or -1 with errno set. */
static int new_file(const char *path, const char *src, size_t written, size_t size) {
    int fd;
    while ((fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666)) < 0 && errno == EINTR)
        ;  /* a signal on a network file system (NFS, FUSE); Python's os.open retries alike */
    if (fd < 0)
        return -1;
    int failed = 0;
    for (size_t done = 0; done < written && !failed;) {
        ssize_t put = write(fd, src + done, written - done);
        if (put == 0)
            errno = ENOSPC;
        if (put == 0 || (put < 0 && errno != EINTR))
            failed = 1;
        done += put > 0 ? (size_t)put : 0;
    }
    if (!failed && written < size) {
        int cut;
        while ((cut = ftruncate(fd, (off_t)size)) != 0 && errno == EINTR)
            ;
        failed = cut != 0;
    }
#ifdef __linux__
    if (!failed)
        sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
    int saved = errno;
    if (close(fd) != 0 && !failed)
        return -1;
    errno = saved;
    return failed ? -1 : 0;
}

enum { SRC_FLOAT32, SRC_BFLOAT16, SRC_FLOAT16 };
enum { OK, SHORT_FILE, FAILED_DIR, FAILED_FILE, FAILED_READ };

#define MAX_DIRS 4

/* The paths of the `dirs` sequence as bytes into made[] (a new reference each); their count, or -1
 * with an exception set. */
static Py_ssize_t fs_paths(PyObject *dirs, PyObject **made) {
    PyObject *seq = PySequence_Fast(dirs, "f16_file: dirs must be a sequence of paths");
    if (seq == NULL)
        return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), i = 0;
    if (count > MAX_DIRS)
        PyErr_Format(PyExc_ValueError, "f16_file: %zd directories to make, at most %d", count, MAX_DIRS);
    else
        for (; i < count && PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &made[i]); i++)
            ;
    Py_DECREF(seq);
    if (i == count)
        return count;
    while (i > 0)
        Py_DECREF(made[--i]);
    return -1;
}

static PyObject *f16_file(PyObject *self, PyObject *args) {
    PyObject *source, *dirs, *file, *made[MAX_DIRS];
    int fd, src_dtype;
    long long offset;
    Py_ssize_t n, n_dirs;
    Py_buffer wide, out;
    if (!PyArg_ParseTuple(args, "iO&Linw*w*OO&:f16_file", &fd, PyUnicode_FSConverter, &source, &offset, &src_dtype,
                          &n, &wide, &out, &dirs, PyUnicode_FSConverter, &file))
        return NULL;
    Py_ssize_t special = 0, failed_dir = 0;
    int outcome = OK, err = 0;
    if ((n_dirs = fs_paths(dirs, made)) < 0) {
        outcome = -1;
    } else if (src_dtype < 0 || src_dtype > 2 || n < 0 || n > out.len / 2 ||
               (src_dtype != SRC_FLOAT16 && n > wide.len / 4)) {  /* divided: n * 4 could overflow */
        PyErr_Format(PyExc_ValueError, "f16_file: %zd values into %zd float16 bytes (%zd float32 bytes of room)",
                     n, out.len, wide.len);
        outcome = -1;
    } else {
        Py_BEGIN_ALLOW_THREADS
        char *dst = (char *)out.buf;
        size_t src_bytes = (size_t)n * (src_dtype == SRC_FLOAT32 ? 4 : 2);
        char *landing = src_dtype == SRC_FLOAT32 ? (char *)wide.buf : dst;  /* bfloat16 lands in out, widens */
        int read = pread_all(fd, landing, src_bytes, (off_t)offset);
        if (read != 0) {
            outcome = read > 0 ? SHORT_FILE : FAILED_READ;
        } else {
            if (src_dtype == SRC_BFLOAT16) {
                const uint16_t *bits = (const uint16_t *)dst;
                uint32_t *widened = (uint32_t *)wide.buf;
                for (Py_ssize_t i = 0; i < n; i++)
                    widened[i] = (uint32_t)bits[i] << 16;
            }
            if (src_dtype != SRC_FLOAT16)
                special = cast((const float *)wide.buf, (uint16_t *)dst, n);
            memset(dst + n * 2, 0, (size_t)(out.len - n * 2));
            if (special == 0) {  /* else the caller redoes those few with numpy (NaN payloads), then writes */
                for (; failed_dir < n_dirs && outcome == OK; failed_dir++) {
                    int made_dir;
                    while ((made_dir = mkdir(PyBytes_AS_STRING(made[failed_dir]), 0777)) != 0 && errno == EINTR)
                        ;
                    if (made_dir != 0)
                        outcome = FAILED_DIR;
                }
                if (outcome == OK && new_file(PyBytes_AS_STRING(file), dst, (size_t)n * 2, (size_t)out.len) != 0)
                    outcome = FAILED_FILE;
            }
        }
        err = errno;
        Py_END_ALLOW_THREADS
    }
    PyObject *result = NULL;
    if (outcome == OK)
        result = PyLong_FromSsize_t(special);
    else if (outcome == SHORT_FILE)
        result = PyLong_FromLong(-1);
    else if (outcome > 0) {  /* OSError(errno, "path: reason"), as the writers name a file they cannot write */
        PyObject *path = outcome == FAILED_DIR ? made[failed_dir - 1] : outcome == FAILED_FILE ? file : source;
        /* the path decoded as os.fsdecode does (undecodable bytes as surrogates), as Python's errors name it */
        PyObject *name = PyUnicode_DecodeFSDefault(PyBytes_AS_STRING(path));
        PyObject *exc = name == NULL ? NULL : PyObject_CallFunction(PyExc_OSError, "iN", err,
                                                                     PyUnicode_FromFormat("%U: %s", name, strerror(err)));
        Py_XDECREF(name);
        if (exc != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    }
    for (Py_ssize_t i = 0; i < (n_dirs > 0 ? n_dirs : 0); i++)
        Py_DECREF(made[i]);
    Py_DECREF(source);
    Py_DECREF(file);
    PyBuffer_Release(&wide);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"f32_to_f16", f32_to_f16, METH_VARARGS,
     "f32_to_f16(src, dst) -> int: float32 buffer src cast into float16 buffer dst (round to nearest even, "
     "no GIL); returns how many outputs are inf or NaN."},
    {"f16_file", f16_file, METH_VARARGS,
     "f16_file(fd, source, offset, src_dtype, n, wide, out, dirs, file) -> int: n values read from fd (the file "
     "named source) at offset (src_dtype 0 float32, 1 bfloat16, 2 float16), as float16 in out (zeros past them), "
     "written to the new file `file` after making the directories `dirs` (at most 4, in order): its first n "
     "values, the rest a hole; the disk started on it. `wide`: room for n float32 values. Returns 0; or how many "
     "outputs are inf or NaN, leaving dirs and file unmade (NaN payloads are numpy's to set); or -1 when the "
     "source ends first. An OSError names the path that failed. No GIL."},
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
