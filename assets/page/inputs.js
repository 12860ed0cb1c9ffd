// What the demo page says of values the browser would change in silence (app.py puts it in the page's head).
// Written for this project, under the same terms as its code.
//
// 1. A number typed out of a slider's range: the slider clamps it; this says so beside the box.
// 2. A picture put in the image-to-image editor: the editor sends it only when Generate is clicked, as a
//    PNG, and the server takes no upload over its limit (413), which Gradio's editor shows nowhere. So a
//    file over the limit is refused at once with a sentence, and a picture of more pixels than a PNG under
//    the limit holds is scaled down in the browser (the demo fits it to the model's sizes anyway), said.
const MAX_UPLOAD_BYTES = 8 * 1024 * 1024;  // app.py's MAX_UPLOAD
const MAX_EDITOR_SIDE = 1600;  // 1600x1600 RGB is 7.7 MB even as incompressible PNG

function say(anchor, id, text) {
  let note = document.getElementById(id);
  if (!note) {
    note = document.createElement("div");
    note.id = id;
    note.className = "input-note";
    note.setAttribute("role", "status");
    anchor.after(note);
  }
  note.textContent = text;
  clearTimeout(note.timer);
  note.timer = setTimeout(() => note.remove(), 12000);
}

function labelOf(input) {
  const block = input.closest(".block");
  const label = block && block.querySelector("[data-testid='block-info'], label span");
  return label ? label.textContent.trim() : "This value";
}

document.addEventListener("change", (event) => {
  const input = event.target;
  if (!(input instanceof HTMLInputElement) || input.type !== "number" || input.value === "") return;
  const value = Number(input.value), low = input.min === "" ? -Infinity : Number(input.min);
  const high = input.max === "" ? Infinity : Number(input.max);
  if (value >= low && value <= high) return;
  const kept = Math.min(Math.max(value, low), high);
  say(input.closest(".block") || input, `note-${labelOf(input).replace(/\W+/g, "-")}`,
      `${labelOf(input)}: from ${low} to ${high}; ${value} was set to ${kept}.`);
}, true);

document.addEventListener("change", async (event) => {
  const input = event.target;
  if (!(input instanceof HTMLInputElement) || input.type !== "file" || !input.closest("#image-editor")
      || input.dataset.checked || !input.files || !input.files.length) return;
  event.stopImmediatePropagation();  // the editor sees the picture once checked (below), or not at all
  const file = input.files[0];
  const editor = input.closest("#image-editor");
  const megabytes = (bytes) => (bytes / 1024 / 1024).toFixed(1);
  if (file.size > MAX_UPLOAD_BYTES) {
    input.value = "";
    say(editor, "image-note", `The picture is ${megabytes(file.size)} MB; this demo takes pictures of up to `
        + `${megabytes(MAX_UPLOAD_BYTES)} MB: save it smaller (a JPEG, or fewer pixels) and upload it again.`);
    return;
  }
  let passed = file;
  try {
    const bitmap = await createImageBitmap(file);
    const scale = MAX_EDITOR_SIDE / Math.max(bitmap.width, bitmap.height);
    if (scale < 1) {
      const canvas = document.createElement("canvas");
      canvas.width = Math.round(bitmap.width * scale);
      canvas.height = Math.round(bitmap.height * scale);
      canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
      const blob = await new Promise((done) => canvas.toBlob(done, "image/png"));
      passed = new File([blob], file.name.replace(/\.\w+$/, "") + ".png", {type: "image/png"});
      say(editor, "image-note", `The picture is ${bitmap.width}x${bitmap.height}: scaled to `
          + `${canvas.width}x${canvas.height} in the browser (the demo fits it to the model's sizes anyway).`);
    }
  } catch (error) {
    // Not a picture the browser decodes: the editor says so itself.
  }
  const files = new DataTransfer();
  files.items.add(passed);
  input.files = files.files;
  input.dataset.checked = "1";
  input.dispatchEvent(new Event("change", {bubbles: true}));
  delete input.dataset.checked;
}, true);
