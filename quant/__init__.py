"""softq.quant"""
