"""`dimd pack`: sources (folder tree, list file, Caffe LMDB), resize/encode, the writer, verify."""
