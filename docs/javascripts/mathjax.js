// MathJax 3, loaded from a CDN by the reader's browser (the build itself is offline).
//
// It typesets two kinds of math:
// * the prose and docstrings: pymdownx.arithmatex (generic mode) wraps formulas in
//   <span class="arithmatex">\( ... \)</span> and <div class="arithmatex">\[ ... \]</div>;
// * the notebooks (mkdocs-jupyter): markdown cells (class jp-MarkdownOutput) and LaTeX
//   outputs (jp-RenderedLatex) keep Jupyter's $ ... $ and $$ ... $$.
// Nothing else on a page is scanned, so a dollar sign in code or in an output stays as it is.
(function () {
  if (window.MathJax && (window.MathJax.Hub || window.MathJax.typesetPromise)) {
    return; // the page already loaded a MathJax of its own
  }
  window.MathJax = {
    tex: {
      inlineMath: [["\\(", "\\)"], ["$", "$"]],
      displayMath: [["\\[", "\\]"], ["$$", "$$"]],
      processEscapes: true,
      processEnvironments: true,
    },
    options: {
      ignoreHtmlClass: ".*|",
      processHtmlClass: "arithmatex|jp-MarkdownOutput|jp-RenderedLatex",
    },
  };
  var script = document.createElement("script");
  script.src = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js";
  script.async = true;
  document.head.appendChild(script);
})();
