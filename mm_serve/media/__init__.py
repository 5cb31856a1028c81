"""Front-end media: image loading and preprocessing (in the API process), and the HTTP/file
fetch policy for ``image_url`` parts. Workers receive preprocessed pixels only."""
