"""The constants that define ``lmcompress::int8_softmax`` (:mod:`lmcompress.kernels.reference`),
read by the reference and the Triton kernel alike (:mod:`lmcompress.kernels.triton_softmax`).
"""

BLOCK = 64  # columns per step of the online max/sum (part of the definition, see above)
LOG2E = 1.4426950216293335  # log2(e) rounded to float32
MIN_EXP_ARG = -88.0  # exp(-88) < 2**-126: flushed to 0 (and no overflow in x * LOG2E)
# 2**f ~ sum_k c_k f**k on [0, 1), relative minimax (Lawson) fit with c_0 = 1, coefficients
# rounded to float32 (so both sides read the same constants): max relative error 9.0e-8.
EXP2_COEFFS = (
    1.0,
    0.6931470632553101,
    0.2402293086051941,
    0.05548528581857681,
    0.009675448760390282,
    0.0012467827182263136,
    0.00021613096760120243,
)
MASKED_AT = -1.0e4  # an additive mask at or below this marks a key as not allowed
DEFAULT_SCALE = 1.0 / 255.0
