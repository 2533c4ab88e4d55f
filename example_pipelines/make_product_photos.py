"""Draws the product photos of the catalog example (example_pipelines/defs/product_photos.py):
flat-colored products on a light background, a few KB each as PNG, and their list in
data/product_photos.csv. Run once; the files are committed.

    python -m example_pipelines.make_product_photos
"""

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

DATA = Path(__file__).resolve().parent / "data"
PHOTOS = DATA / "product_photos"
SIZE = 160
BACKGROUND = (238, 238, 232)
INK = (40, 40, 40)


@dataclass(frozen=True)
class Product:
    """One photo: its id, what it shows (for people reading the table) and how it is drawn."""

    id: str
    name: str
    color: tuple[int, int, int]
    draw: Callable[[ImageDraw.ImageDraw, tuple[int, int, int]], None]


def mug(d: ImageDraw.ImageDraw, color: tuple[int, int, int]) -> None:
    d.ellipse((108, 62, 140, 108), outline=color, width=9)
    d.rectangle((38, 45, 114, 125), fill=color)


def t_shirt(d: ImageDraw.ImageDraw, color: tuple[int, int, int]) -> None:
    d.polygon([(52, 30), (108, 30), (140, 58), (122, 76), (112, 68), (112, 134), (48, 134), (48, 68), (38, 76),
               (20, 58)], fill=color)


def bottle(d: ImageDraw.ImageDraw, color: tuple[int, int, int]) -> None:
    d.rectangle((70, 18, 90, 44), fill=color)
    d.rounded_rectangle((52, 44, 108, 142), radius=14, fill=color)


def book(d: ImageDraw.ImageDraw, color: tuple[int, int, int]) -> None:
    d.rectangle((40, 22, 120, 138), fill=color)
    d.rectangle((40, 22, 50, 138), fill=INK)
    d.text((58, 48), "FIELD\nGUIDE", fill=(255, 255, 255), font=ImageFont.load_default(16))


def ball(d: ImageDraw.ImageDraw, color: tuple[int, int, int]) -> None:
    d.ellipse((34, 34, 126, 126), fill=color)
    d.arc((34, 60, 126, 100), 0, 180, fill=(255, 255, 255), width=4)


def gift_box(d: ImageDraw.ImageDraw, color: tuple[int, int, int]) -> None:
    d.rectangle((30, 54, 130, 136), fill=color)
    d.rectangle((74, 54, 86, 136), fill=(250, 220, 90))
    d.text((48, 20), "SALE", fill=INK, font=ImageFont.load_default(26))


PRODUCTS = (
    Product("P-100", "ceramic mug", (200, 40, 40), mug),
    Product("P-101", "cotton t-shirt", (40, 80, 200), t_shirt),
    Product("P-102", "water bottle", (40, 150, 70), bottle),
    Product("P-103", "field guide book", (230, 120, 30), book),
    Product("P-104", "rubber ball", (235, 200, 40), ball),
    Product("P-105", "gift box", (130, 60, 160), gift_box),
)


def main() -> None:
    PHOTOS.mkdir(parents=True, exist_ok=True)
    with (DATA / "product_photos.csv").open("w", newline="") as file:
        table = csv.writer(file)
        table.writerow(["product_id", "name", "photo"])
        for product in PRODUCTS:
            image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
            product.draw(ImageDraw.Draw(image), product.color)
            name = f"{product.id.lower()}.png"
            image.quantize(16).save(PHOTOS / name, optimize=True)  # a 16-color palette: a few KB
            table.writerow([product.id, product.name, f"product_photos/{name}"])


if __name__ == "__main__":
    main()
