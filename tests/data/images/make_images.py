"""Writes the JPEGs of tests/data/image_decode_test.cpp and what Pillow decodes them to.

Pillow decodes JPEG with libjpeg-turbo's defaults, as hddp does (src/data/image_jpeg.cpp):
the test checks hddp's pixels against Pillow's to the bit. Run with a Python that has
Pillow (the torch virtual environment of scripts/setup.sh has it), from anywhere:

    /opt/hddp-venv/bin/python tests/data/images/make_images.py

Each NAME.jpg but cmyk.jpg and truncated.jpg gets NAME.rgb (height x width x 3 bytes, Pillow's RGB decoding) and
NAME.y (height x width bytes: libjpeg's grayscale output, the Y plane, through
Image.draft("L")). 26 x 17 pixels: an even width, a height that is no multiple of 8 or
16; odd-422.jpg is 25 pixels wide (stb_image, hddp's decoder before, interpolated its
last column past the edge).
"""
import io
import pathlib

from PIL import Image

HERE = pathlib.Path(__file__).resolve().parent


def pattern(width, height):
    image = Image.new("RGB", (width, height))
    image.putdata([((x * 37 + y * 11) % 256, (y * 23 + 60) % 256, ((x ^ y) * 19) % 256)
                   for y in range(height) for x in range(width)])
    return image


def main():
    rgb = pattern(26, 17)
    jpegs = {
        "rgb-444.jpg": (rgb, {"quality": 90, "subsampling": 0}),
        "rgb-422.jpg": (rgb, {"quality": 90, "subsampling": 1}),
        "rgb-420.jpg": (rgb, {"quality": 75, "subsampling": 2}),
        "progressive.jpg": (rgb, {"quality": 80, "progressive": True}),
        "gray.jpg": (rgb.convert("L"), {"quality": 90}),
        "odd-422.jpg": (pattern(25, 17), {"quality": 90, "subsampling": 1}),
    }
    for name, (image, options) in jpegs.items():
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", **options)
        (HERE / name).write_bytes(buffer.getvalue())
        stem = name[:-len(".jpg")]
        (HERE / (stem + ".rgb")).write_bytes(Image.open(HERE / name).convert("RGB").tobytes())
        gray = Image.open(HERE / name)
        gray.draft("L", gray.size)
        assert gray.mode == "L" and gray.size == image.size
        (HERE / (stem + ".y")).write_bytes(gray.tobytes())
    # CMYK (Adobe, inverted), compared with stb_image only: Pillow inverts it back.
    rgb.convert("CMYK").save(HERE / "cmyk.jpg", quality=90)
    # Cut off inside its scan (tests/data/image_mask_test.cpp): Pillow raises "image file
    # is truncated", hddp a DataError.
    (HERE / "truncated.jpg").write_bytes((HERE / "rgb-444.jpg").read_bytes()[:900])


if __name__ == "__main__":
    main()
