/*
 * One window of a JPEG, decoded alone: libjpeg-turbo's jpeg_crop_scanline and
 * jpeg_skip_scanlines (what TensorFlow's decode_and_crop_jpeg uses), at a DCT
 * scale of 1/1, 1/2, 1/4 or 1/8. Built and loaded by jpeg_window.py.
 *
 * The rows above the window are entropy-decoded only (no IDCT, upsampling or
 * colour conversion), the columns beside it are not transformed, and decoding
 * stops after its last row. The pixels are those of decoding the whole image
 * at that scale and cutting the window out (tests/test_jpeg_window.py), with
 * libjpeg's defaults as TurboJPEG's decode uses them (accurate integer IDCT,
 * fancy upsampling).
 */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jpeglib.h"

/* libjpeg's errors longjmp back here; a warning (corrupt data, a premature
 * end) is one too, as TurboJPEG's callers see it. */
struct failure {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char *message;
};

static void fail(j_common_ptr info) {
  struct failure *failure = (struct failure *)info->err;
  (*info->err->format_message)(info, failure->message);
  longjmp(failure->jump, 1);
}

static void fail_on_warning(j_common_ptr info, int level) {
  if (level < 0) fail(info);
}

/* Columns decoded beside the window: fancy upsampling treats the edges of
 * the decoded columns as the image's, which changes the outermost pixels. */
#define MARGIN 8

int tps_jpeg_message_size(void) { return JMSG_LENGTH_MAX; }

/*
 * Decode rows [top, bottom) and columns [left, right) of the image scaled by
 * 1/denom into out (bottom - top rows of (right - left) * channels bytes),
 * grey (1 channel) or RGB (3). 0 on success; -1 with the reason in message
 * (tps_jpeg_message_size() bytes) if the data cannot be read or the window
 * is not inside the scaled image.
 */
int tps_jpeg_decode_window(const unsigned char *data, unsigned long size, int denom, int grey, int left,
                           int top, int right, int bottom, unsigned char *out, char *message) {
  struct jpeg_decompress_struct info;
  struct failure failure;
  unsigned char *volatile row = NULL;
  const int channels = grey ? 1 : 3;

  info.err = jpeg_std_error(&failure.pub);
  failure.pub.error_exit = fail;
  failure.pub.emit_message = fail_on_warning;
  failure.message = message;
  message[0] = '\0';
  if (setjmp(failure.jump)) {
    jpeg_destroy_decompress(&info);
    free(row);
    return -1;
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, data, size);
  jpeg_read_header(&info, TRUE);
  info.scale_num = 1;
  info.scale_denom = denom;
  info.out_color_space = grey ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(&info);
  if (left < 0 || top < 0 || left >= right || top >= bottom || right > (int)info.output_width ||
      bottom > (int)info.output_height) {
    snprintf(message, JMSG_LENGTH_MAX, "window [%d, %d) x [%d, %d) outside the %ux%u image", left, right,
             top, bottom, info.output_width, info.output_height);
    jpeg_destroy_decompress(&info);
    return -1;
  }
  const int from = left > MARGIN ? left - MARGIN : 0;
  const int to = right + MARGIN < (int)info.output_width ? right + MARGIN : (int)info.output_width;
  JDIMENSION x = from, width = to - from;
  jpeg_crop_scanline(&info, &x, &width); /* widened to whole iMCUs: x <= from, x + width >= to */
  row = malloc((size_t)width * channels);
  if (row == NULL) {
    snprintf(message, JMSG_LENGTH_MAX, "out of memory for a row of %u pixels", width);
    jpeg_destroy_decompress(&info);
    return -1;
  }
  if (top > 0) jpeg_skip_scanlines(&info, top);
  const size_t skip = (size_t)(left - (int)x) * channels, span = (size_t)(right - left) * channels;
  JSAMPROW rows[1] = {row};
  for (int y = top; y < bottom; y++) {
    jpeg_read_scanlines(&info, rows, 1);
    memcpy(out + (size_t)(y - top) * span, row + skip, span);
  }
  free(row);
  jpeg_abort_decompress(&info); /* the rows below the window are never read */
  jpeg_destroy_decompress(&info);
  return 0;
}
