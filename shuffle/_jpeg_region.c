/* Decode only the rows and columns of a JPEG that a crop needs, with the GIL released.
 *
 * Why: a random-resized crop keeps on average about half of the image, but
 * Pillow decodes all of it, and the full decode is about 70 % of the
 * loader's CPU per image. libjpeg-turbo (>= 1.5) can decode a region:
 * jpeg_crop_scanline() limits the inverse DCT, upsampling and colour
 * conversion to the columns of the crop (rounded out to whole iMCUs),
 * jpeg_skip_scanlines() skips the rows above it without the inverse DCT, and
 * the rows below it are never read. The region's pixels are those of the
 * full decode (same library, same settings as Pillow: islow DCT, fancy
 * upsampling), so the crop resized from them is the same image.
 *
 * Only 3-component YCbCr JPEGs take this path; shape() says which, and the
 * caller decodes the others (grey, CMYK) with Pillow as before. A libjpeg
 * warning (corrupt or extraneous data inside the rows decoded) stops the
 * decode with a message that starts "warning: ": the caller hands such an
 * image to Pillow, which tolerates some warnings and refuses the rest, so
 * what decodes is what decoded before.
 *
 * Python API (module dimd.shuffle._jpeg_region):
 *   shape(data) -> (width, height, region_ok)
 *   decode(data, scale, x0, y0, x1, y1, out) -> (left, top, width, height)
 *       scale: DCT scaling denominator (1, 2, 4, 8); the box is in scaled
 *       pixels, end exclusive; out: a writable buffer that receives RGBX
 *       rows of the region actually decoded, (left, top) its top-left
 *       corner (left rounded down to an iMCU: at most 15 more columns).
 *       The GIL is released for the whole decode.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#if !defined(JCS_EXTENSIONS) || JPEG_LIB_VERSION < 62
#error "libjpeg-turbo (JCS_EXTENSIONS, jpeg_crop_scanline) is needed"
#endif

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf escape;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void on_error(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->escape, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0) {   /* a warning (corrupt or extraneous data): Pillow, which tolerates some, decides */
        ErrorManager *err = (ErrorManager *)cinfo->err;
        char message[JMSG_LENGTH_MAX];
        (*cinfo->err->format_message)(cinfo, message);
        snprintf(err->message, JMSG_LENGTH_MAX, "warning: %s", message);
        longjmp(err->escape, 1);
    }
}

static void start(struct jpeg_decompress_struct *cinfo, const Py_buffer *data) {
    jpeg_create_decompress(cinfo);
    jpeg_mem_src(cinfo, (const unsigned char *)data->buf, (unsigned long)data->len);
    jpeg_read_header(cinfo, TRUE);
}

static int region_ok(const struct jpeg_decompress_struct *cinfo) {
    return cinfo->num_components == 3 && cinfo->jpeg_color_space == JCS_YCbCr;
}

static void init_errors(struct jpeg_decompress_struct *cinfo, ErrorManager *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->message[0] = '\0';
}

/* The header's size and whether a region can be decoded; 0, or -1 with err->message. No Python here. */
static int read_shape(const Py_buffer *data, JDIMENSION *width, JDIMENSION *height, int *ok, ErrorManager *err) {
    struct jpeg_decompress_struct cinfo;
    init_errors(&cinfo, err);
    if (setjmp(err->escape)) {
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    start(&cinfo, data);
    *width = cinfo.image_width;
    *height = cinfo.image_height;
    *ok = region_ok(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

/* Decode the region into ``out`` (RGBX rows of *width pixels); 0, or -1 with err->message. No Python here. */
static int read_region(const Py_buffer *data, Py_buffer *out, int scale, JDIMENSION x0, JDIMENSION y0,
                       JDIMENSION x1, JDIMENSION y1, JDIMENSION *left, JDIMENSION *width, ErrorManager *err) {
    struct jpeg_decompress_struct cinfo;
    init_errors(&cinfo, err);
    if (setjmp(err->escape)) {
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    start(&cinfo, data);
    if (!region_ok(&cinfo)) {
        snprintf(err->message, JMSG_LENGTH_MAX, "not a 3-component YCbCr JPEG");
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)scale;
    cinfo.out_color_space = JCS_EXT_RGBX;
    jpeg_calc_output_dimensions(&cinfo);
    if (!(x0 < x1 && y0 < y1 && x1 <= cinfo.output_width && y1 <= cinfo.output_height)) {
        snprintf(err->message, JMSG_LENGTH_MAX, "region (%u, %u, %u, %u) is not inside the %ux%u image",
                 x0, y0, x1, y1, cinfo.output_width, cinfo.output_height);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_start_decompress(&cinfo);
    *left = x0;
    *width = x1 - x0;
    jpeg_crop_scanline(&cinfo, left, width);   /* left moves down to an iMCU boundary, width grows */
    size_t stride = (size_t)*width * 4;
    if ((size_t)out->len < stride * (y1 - y0)) {
        snprintf(err->message, JMSG_LENGTH_MAX, "output buffer of %zd bytes, the region needs %zu",
                 out->len, stride * (y1 - y0));
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    if (y0 > 0) {
        jpeg_skip_scanlines(&cinfo, y0);
    }
    unsigned char *pixels = (unsigned char *)out->buf;
    while (cinfo.output_scanline < y1) {
        JSAMPROW row = pixels + (size_t)(cinfo.output_scanline - y0) * stride;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_abort_decompress(&cinfo);   /* the rows below the region are never read */
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static PyObject *shape(PyObject *self, PyObject *args) {
    Py_buffer data;
    ErrorManager err;
    JDIMENSION width = 0, height = 0;
    int ok = 0, status;
    if (!PyArg_ParseTuple(args, "y*", &data)) {
        return NULL;
    }
    status = read_shape(&data, &width, &height, &ok, &err);
    PyBuffer_Release(&data);
    if (status < 0) {
        return PyErr_Format(PyExc_ValueError, "%s", err.message);
    }
    return Py_BuildValue("(IIO)", width, height, ok ? Py_True : Py_False);
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    int scale, status;
    unsigned int x0, y0, x1, y1;
    JDIMENSION left = 0, width = 0;
    ErrorManager err;
    if (!PyArg_ParseTuple(args, "y*iIIIIw*", &data, &scale, &x0, &y0, &x1, &y1, &out)) {
        return NULL;
    }
    if (scale != 1 && scale != 2 && scale != 4 && scale != 8) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&out);
        return PyErr_Format(PyExc_ValueError, "scale must be 1, 2, 4 or 8, got %d", scale);
    }
    Py_BEGIN_ALLOW_THREADS
    status = read_region(&data, &out, scale, x0, y0, x1, y1, &left, &width, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (status < 0) {
        return PyErr_Format(PyExc_ValueError, "%s", err.message);
    }
    return Py_BuildValue("(IIII)", left, y0, width, y1 - y0);
}

static PyMethodDef methods[] = {
    {"shape", shape, METH_VARARGS, "shape(data) -> (width, height, region_ok): a JPEG's size from its header."},
    {"decode", decode, METH_VARARGS,
     "decode(data, scale, x0, y0, x1, y1, out) -> (left, top, width, height): the region decoded into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg_region", "Decode only the region of a JPEG that a crop needs (libjpeg-turbo).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__jpeg_region(void) {
    return PyModule_Create(&module);
}
