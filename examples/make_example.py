"""Regenerate examples/keras_masked_bigru_lstm.onnx (the model README's first command optimizes).

A small Keras 3 model exported with tf2onnx 1.17: Masking -> Bidirectional(GRU) -> LSTM -> Dense. tf2onnx
writes every masked recurrent layer as a Loop; rnnfuse turns them into one bidirectional GRU and one LSTM.
Run: python examples/make_example.py   (needs tensorflow, tf2onnx: pip install ".[exporters]")
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402

keras.utils.set_random_seed(0)
inp = keras.Input((None, 4), name="features")
x = keras.layers.Masking(0.0)(inp)
x = keras.layers.Bidirectional(keras.layers.GRU(8, return_sequences=True))(x)
x = keras.layers.LSTM(8)(x)
out = keras.layers.Dense(2)(x)
model = keras.Model(inp, out)
spec = (tf.TensorSpec((None, None, 4), tf.float32, name="features"),)
proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
here = os.path.dirname(os.path.abspath(__file__))
path = os.path.join(here, "keras_masked_bigru_lstm.onnx")
onnx.save(proto, path)
# Keras' own answer on a pre-padded batch, for the README's check
x = np.random.default_rng(0).standard_normal((3, 6, 4)).astype(np.float32)
x[1, :2] = 0.0  # pre-padded row (Keras pad_sequences default)
x[2, 4:] = 0.0  # post-padded row
np.savez(os.path.join(here, "keras_masked_bigru_lstm.npz"), features=x, expected=model(x).numpy())
print(path, os.path.getsize(path), "bytes")
