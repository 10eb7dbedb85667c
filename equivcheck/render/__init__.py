"""What a report looks like: text, JSON rows, Markdown, HTML, the terminal overview, progress, results files."""
