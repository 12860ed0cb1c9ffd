"""Prompt styles: each wraps the user's prompt and adds a negative prompt."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Style:
    prompt: str  # "{prompt}" is replaced by the user's prompt
    negative_prompt: str

    def apply(self, prompt: str, negative_prompt: str) -> tuple[str, str]:
        negatives = ", ".join(p for p in (self.negative_prompt, negative_prompt.strip()) if p)
        return self.prompt.replace("{prompt}", prompt.strip()), negatives


NO_STYLE = "No style"
STYLES = {
    NO_STYLE: Style("{prompt}", ""),
    "Cinematic": Style(
        "cinematic film still of {prompt}, shallow depth of field, dramatic lighting, film grain, anamorphic, epic",
        "cartoon, anime, illustration, painting, drawing, text, deformed, ugly",
    ),
    "Photographic": Style(
        "photograph of {prompt}, 50mm, natural light, sharp focus, highly detailed, professional photography",
        "drawing, painting, illustration, cartoon, anime, render, text, deformed",
    ),
    "Anime": Style(
        "anime artwork of {prompt}, anime style, key visual, vibrant colors, studio anime, highly detailed",
        "photograph, photorealistic, realistic, 3d render, deformed, ugly",
    ),
    "Manga": Style(
        "manga panel of {prompt}, black and white ink, screentone, dynamic composition, japanese comic style",
        "color, photograph, photorealistic, 3d render, western comic, deformed",
    ),
    "Digital art": Style(
        "digital artwork of {prompt}, concept art, painterly, highly detailed, trending illustration",
        "photograph, photorealistic, text, watermark, deformed, ugly",
    ),
    "Pixel art": Style(
        "pixel art of {prompt}, 16-bit, crisp pixels, limited palette, retro game sprite",
        "photograph, photorealistic, blurry, smooth gradients, 3d render, deformed",
    ),
    "Fantasy art": Style(
        "fantasy painting of {prompt}, magical, ethereal, epic scale, intricate detail, mythical atmosphere",
        "photograph, modern, mundane, text, watermark, deformed, ugly",
    ),
    "Neonpunk": Style(
        "neonpunk style {prompt}, cyberpunk, neon lights, vaporwave, glowing magenta and cyan, futuristic, moody",
        "daylight, pastel, muted colors, painting, drawing, deformed, ugly",
    ),
    "3D model": Style(
        "professional 3d render of {prompt}, octane render, global illumination, physically based materials",
        "photograph, painting, drawing, sketch, 2d, flat, deformed, ugly",
    ),
}
