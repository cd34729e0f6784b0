"""The plan report: text and markdown, the HTML page, and "no plan fits" explained."""
