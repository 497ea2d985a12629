"""The input images the examples' Load Image nodes name, drawn as small placeholders.

Comfy-Org's MiniMax-H3 templates name pictures that ComfyUI does not ship (its template packages hold
them for the cloud only), so a user who opens the pack's image- and reference-to-video examples would
meet "missing input" for each. The pack ships a simple drawing under each name in
example_workflows/input/ (ComfyUI serves it beside the examples, and the examples' note says to copy it
into ComfyUI's input folder). tests/make_example_workflows.py writes them; tests/test_example_workflows.py
checks that the committed files are these drawings.
"""
from pathlib import Path

INPUT_DIR = Path(__file__).resolve().parent.parent / "example_workflows" / "input"


def _gradient(size, top, bottom):
    from PIL import Image
    width, height = size
    column = Image.new("RGB", (1, height))
    column.putdata([tuple(round(a + (b - a) * y / (height - 1)) for a, b in zip(top, bottom)) for y in range(height)])
    return column.resize(size)


def gaming_mouse():
    """A gaming mouse seen from above, its RGB strip lit, on a transparent background (768 x 768)."""
    from PIL import Image, ImageDraw
    image = Image.new("RGBA", (768, 768), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.ellipse((214, 84, 554, 684), fill=(40, 44, 52, 235), outline=(120, 128, 140, 255), width=6)
    draw.line((384, 90, 384, 330), fill=(16, 18, 22, 255), width=5)             # the two buttons
    draw.rounded_rectangle((366, 170, 402, 262), radius=16, fill=(90, 96, 108, 255))   # the wheel
    for index, color in enumerate([(255, 40, 60), (255, 160, 0), (60, 220, 90), (40, 140, 255), (170, 70, 255)]):
        inset = 28 + 10 * index
        draw.arc((214 + inset, 84 + inset, 554 - inset, 684 - inset), 200, 340, fill=color + (255,), width=8)
    draw.ellipse((330, 560, 438, 640), fill=(60, 220, 200, 200))                 # the logo, lit
    return image


def superboy_on_roof():
    """A boy in red with a cape on a city roof at night, the skyline behind (768 x 432)."""
    from PIL import ImageDraw
    image = _gradient((768, 432), (12, 16, 48), (60, 40, 90))
    draw = ImageDraw.Draw(image)
    for index, (left, width, top) in enumerate([(0, 90, 170), (100, 70, 120), (180, 110, 200), (300, 80, 90),
                                                (390, 120, 150), (520, 70, 110), (600, 90, 190), (700, 68, 140)]):
        draw.rectangle((left, top, left + width, 340), fill=(24, 26, 40))
        for row in range(top + 14, 330, 26):
            for column in range(left + 10, left + width - 10, 20):
                if (row // 26 + column // 20 + index) % 3:
                    draw.rectangle((column, row, column + 8, row + 12), fill=(250, 210, 110))
    draw.rectangle((0, 340, 768, 432), fill=(70, 66, 72))                        # the roof
    draw.rectangle((0, 334, 768, 346), fill=(110, 104, 110))
    draw.polygon([(360, 190), (408, 190), (440, 320), (330, 320)], fill=(150, 10, 20))   # the cape
    draw.polygon([(366, 186), (402, 186), (410, 270), (358, 270)], fill=(220, 30, 40))   # the body
    draw.rectangle((364, 270, 380, 340), fill=(40, 50, 120))                      # the legs
    draw.rectangle((388, 270, 404, 340), fill=(40, 50, 120))
    draw.ellipse((368, 140, 400, 180), fill=(236, 190, 150))                      # the head
    draw.chord((366, 136, 402, 170), 180, 360, fill=(40, 28, 20))                # the hair
    return image


def mecha_dragon():
    """A metal dragon under a storm, a lightning bolt behind it (768 x 432)."""
    from PIL import ImageDraw
    image = _gradient((768, 432), (30, 32, 46), (70, 76, 96))
    draw = ImageDraw.Draw(image)
    draw.line([(560, 0), (520, 110), (575, 130), (500, 260), (545, 270), (470, 432)], fill=(240, 240, 255), width=7)
    draw.line([(560, 0), (520, 110), (575, 130), (500, 260), (545, 270), (470, 432)], fill=(150, 170, 255), width=2)
    steel, dark = (150, 160, 175), (90, 98, 112)
    draw.polygon([(300, 220), (120, 60), (170, 170), (90, 150), (200, 240)], fill=dark)     # the far wing
    draw.polygon([(330, 215), (380, 40), (400, 150), (470, 90), (420, 240)], fill=steel)     # the near wing
    draw.ellipse((220, 200, 470, 290), fill=steel, outline=dark, width=4)        # the body
    draw.polygon([(440, 230), (560, 170), (600, 190), (520, 250), (460, 265)], fill=steel)  # the neck and head
    draw.polygon([(600, 190), (640, 205), (590, 215)], fill=dark)                 # the jaw
    draw.ellipse((568, 182, 580, 192), fill=(255, 80, 30))                        # the eye
    draw.polygon([(230, 250), (80, 330), (20, 320), (210, 270)], fill=dark)      # the tail
    for x in range(250, 460, 30):
        draw.line([(x, 208), (x + 10, 284)], fill=dark, width=3)                  # plates
    return image


#: file name (as the examples' Load Image nodes name it) -> its drawing
DRAWINGS = {"transparent_rgb_gaming_mouse.png": gaming_mouse,
            "red_superboy_on_city_roof.png": superboy_on_roof,
            "mecha_dragon_lightning.png": mecha_dragon}


def load_image_files(workflow) -> list[str]:
    """The pictures a UI workflow's Load Image nodes name, its subgraphs' included."""
    nodes = workflow["nodes"] + [n for s in workflow.get("definitions", {}).get("subgraphs", []) for n in s["nodes"]]
    return [node["widgets_values"][0] for node in nodes if node["type"] == "LoadImage"]


def write(name, folder=INPUT_DIR) -> Path:
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    DRAWINGS[name]().save(path, optimize=True)
    return path
