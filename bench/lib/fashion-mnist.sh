# Sourced by the GPU benchmarks: sets DATA to the trainers' dataset flags, Fashion-MNIST
# from $HDDP_FASHION_MNIST (default Debian's folder) when present, else synthetic 28x28
# grey images (and says so: accuracies are then not comparable).
FM=${HDDP_FASHION_MNIST:-/usr/share/datasets/fashion-mnist}
if [ -e "$FM/train-images-idx3-ubyte.gz" ] || [ -e "$FM/train-images-idx3-ubyte" ]; then
  DATA=(--dataset fashion-mnist --data "$FM")
else
  echo "no Fashion-MNIST at $FM: synthetic data instead (accuracy is not comparable)"
  DATA=(--dataset synthetic --image-size 28 --channels 1)
fi
