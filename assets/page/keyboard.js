// The demo page's keyboard shortcut (app.py puts it in the page's head). Written for this project,
// under the same terms as its code.
// Ctrl+Enter (Cmd+Enter on a Mac) in a prompt box clicks its tab's button.
document.addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || !(event.ctrlKey || event.metaKey)) return;
  const box = event.target.closest("[data-run]");
  const button = box && document.getElementById(box.dataset.run);
  if (button) { event.preventDefault(); button.click(); }
});
const label = () => {
  for (const [box, run] of [["prompt", "generate"], ["image-prompt", "image-generate"], ["grid-prompt", "grid-run"]]) {
    const element = document.getElementById(box);
    if (element) element.dataset.run = run;
  }
};
new MutationObserver(label).observe(document.documentElement, {childList: true, subtree: true});
